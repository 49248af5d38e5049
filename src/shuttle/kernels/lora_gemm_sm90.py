"""The fused LoRA linear's GEMM for Hopper (sm_90), a CuTe-DSL program.

For x (T, K), W (N, K), S (T, R) (the shrink's output, ``(x @ A.T) * scale`` already scaled and
rounded to x's dtype) and B (N, R), one kernel computes::

    out = [x | S] @ [W | B].T + bias        # (T, N), float32 accumulator, rounded once

that is, the base GEMM with its K loop extended by the rank: the producer warp streams
``cdiv(K, BK)`` tile pairs of x and W, then ``cdiv(R, BK)`` pairs of S and B, through the same
shared-memory pipeline (the zero fill of TMA past K or R makes the partial tiles exact), and the
consumer warpgroups never see the seam. At rank 128 over K = 1536 that is 8.3% more MMA work
than the base product.

With ``shrink`` the kernel computes S too, so x is read from memory once: among its work units
are S tiles, ``S^T = (A @ x.T) * scale`` over ``tile.n`` tokens (A's ranks, zero past R, are the
M rows: R <= tile.m), stored transposed into S's memory and read back by the output tiles of
those rows once its flag is set (:mod:`~shuttle.kernels.lora_gemm_units`: the handoff, and
the order that makes it deadlock-free).

The form is CUTLASS's Hopper persistent GEMM, expressed in the CuTe DSL (``nvidia-cutlass-dsl``,
the ``hopper`` extra): one producer warp issuing TMA bulk copies into a ring of ``stages``
buffers, two consumer warpgroups issuing ``wgmma`` out of shared memory, a static persistent
scheduler (one CTA per SM walking the units, so one unit's epilogue overlaps the next one's
loads), and a TMA-store epilogue through shared memory. The bias (and the shrink's scale) are
applied to the float32 accumulator from float32 copies padded to whole tiles (read without a
bound check).

:func:`compile_lora_gemm` compiles it once per (dtype, tile shape, bias or not, SM count,
shrink or not, programmatic dependent launch or not);
:class:`~shuttle.kernels.lora_linear_cute.CuteLoraGemm` launches it for a layer.
"""

# No `from __future__ import annotations`: the DSL reads the jit functions' annotations as
# objects (cute.Tensor, cutlass.Int32), which live in closures, not in this module's globals.
import functools
from typing import Any

import torch

from shuttle.kernels.cute_dsl import CUTE_DTYPES, CUTE_TILES, CuteTile, dsl, numeric
from shuttle.kernels.lora_gemm_sm90_device import EPI_STAGES, THREADS_PER_WARPGROUP, device_kernel

__all__ = ["CUTE_SHRINK_MAX_RANK", "compile_lora_gemm"]


# The most ranks the kernel's own shrink takes: an S tile's ranks are its M rows.
CUTE_SHRINK_MAX_RANK = min(tile.m for tile in CUTE_TILES)
_BARRIER_BYTES = 1024  # the pipeline's mbarriers, rounded up
_SMEM_ALIGN = 1024  # swizzled shared-memory buffers start on 1 KiB


def _stages(tile: CuteTile, epi_tile: tuple[int, int], elem_bytes: int, smem: int) -> int:
    """How many (A, B) tile pairs fit in shared memory beside the epilogue's buffers."""
    ab = (tile.m + tile.n) * tile.k * elem_bytes
    epi = epi_tile[0] * epi_tile[1] * elem_bytes * EPI_STAGES
    return (smem - _BARRIER_BYTES - epi - 2 * _SMEM_ALIGN) // ab


class _Kernel:
    """The DSL program for one (dtype, tile, bias or not, SM count, shrink or not, dependent
    launch or not); see the
    module docstring.

    ``host`` builds the ``@cute.jit`` launcher (tensors from raw pointers, TMA descriptors,
    shared-memory layouts, the grid); the ``@cute.kernel`` it launches
    (:func:`~shuttle.kernels.lora_gemm_sm90_device.device_kernel`) reads the layouts and the
    shared-storage struct it builds as this object's attributes.
    """

    def __init__(self, dtype: torch.dtype, tile: CuteTile, has_bias: bool, sms: int,
                 shrink: bool, pdl: bool):
        self.dtype = dtype
        self.tile = tile
        self.has_bias = has_bias
        self.sms = sms
        self.shrink = shrink
        self.pdl = pdl
        self.consumers = tile.consumers
        self.threads = (1 + self.consumers) * THREADS_PER_WARPGROUP
        self.elem = numeric(dtype)

    def host(self) -> Any:
        """The ``@cute.jit`` launcher, built from pointers and sizes so a call converts nothing."""
        d = dsl()
        cutlass, cute, utils, sm90 = d.cutlass, d.cute, d.utils, d.sm90
        cpasync = cute.nvgpu.cpasync
        tile, consumers, elem, shrink = self.tile, self.consumers, self.elem, self.shrink
        layout_k = utils.LayoutEnum.ROW_MAJOR  # every operand K-major, out N-major
        kernel = device_kernel(self)
        this = self

        @cute.jit
        def launch(x_ptr: cute.Pointer, w_ptr: cute.Pointer, a_ptr: cute.Pointer,
                   s_ptr: cute.Pointer, u_ptr: cute.Pointer, scale_ptr: cute.Pointer,
                   bias_ptr: cute.Pointer, out_ptr: cute.Pointer, table_ptr: cute.Pointer,
                   flags_ptr: cute.Pointer, t: cutlass.Int32, n: cutlass.Int32,
                   k: cutlass.Int32, r: cutlass.Int32, units: cutlass.Int32,
                   s_blocks: cutlass.Int32, stream: Any):
            # Row-major (K-major) operands: x (T, K), W (N, K), A (R, K), B (N, R); out (T, N).
            # S (T, R), or with the shrink (s_blocks * tile.n, R), written by the kernel.
            s_rows = s_blocks * tile.n if shrink else t
            m_x = cute.make_tensor(x_ptr, cute.make_layout((t, k), stride=(k, 1)))
            m_w = cute.make_tensor(w_ptr, cute.make_layout((n, k), stride=(k, 1)))
            m_s = cute.make_tensor(s_ptr, cute.make_layout((s_rows, r), stride=(r, 1)))
            m_u = cute.make_tensor(u_ptr, cute.make_layout((n, r), stride=(r, 1)))
            m_out = cute.make_tensor(out_ptr, cute.make_layout((t, n), stride=(n, 1)))
            # The float32 bias, broadcast over rows (stride 0), padded to whole column tiles;
            # the per-rank scale, broadcast over tokens, padded to tile.m ranks (read without
            # a bound check).
            m_bias = cute.make_tensor(bias_ptr, cute.make_layout((t, n), stride=(0, 1)))
            m_scale = cute.make_tensor(scale_ptr,
                                       cute.make_layout((tile.m, s_rows), stride=(1, 0)))
            # The shrink's work list (one code per unit) and its flags: (S tile ready, readers
            # that saw it) per S tile.
            m_table = cute.make_tensor(table_ptr, cute.make_layout(units))
            m_flags = cute.make_tensor(flags_ptr,
                                       cute.make_layout((s_blocks, 2), stride=(1, s_blocks)))

            this.mma = sm90.make_trivial_tiled_mma(
                elem, elem, layout_k.sm90_mma_major_mode(), layout_k.sm90_mma_major_mode(),
                cutlass.Float32, (1 if tile.pingpong else consumers, 1, 1),
                tiler_mn=(64, tile.n))
            tile_mnk = (tile.m, tile.n, tile.k)
            this.epi_tile = sm90.compute_tile_shape_or_override(
                tile_mnk, elem, is_cooperative=consumers == 2 and not tile.pingpong)
            this.stages = _stages(tile, this.epi_tile, this.dtype.itemsize,
                                  utils.get_smem_capacity_in_bytes("sm_90"))
            this.a_smem = sm90.make_smem_layout_a(layout_k, tile_mnk, elem, this.stages)
            this.b_smem = sm90.make_smem_layout_b(layout_k, tile_mnk, elem, this.stages)
            this.epi_smem = sm90.make_smem_layout_epi(elem, layout_k, this.epi_tile,
                                                      EPI_STAGES)
            # S tiles leave the accumulator transposed (ranks x tokens): stored M-major.
            this.epi_smem_t = sm90.make_smem_layout_epi(elem, utils.LayoutEnum.COL_MAJOR,
                                                        this.epi_tile, EPI_STAGES)
            a_one = cute.slice_(this.a_smem, (None, None, 0))
            b_one = cute.slice_(this.b_smem, (None, None, 0))
            load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
            tma_x, g_x = cpasync.make_tiled_tma_atom(load, m_x, a_one, (tile.m, tile.k))
            tma_s, g_s = cpasync.make_tiled_tma_atom(load, m_s, a_one, (tile.m, tile.k))
            tma_w, g_w = cpasync.make_tiled_tma_atom(load, m_w, b_one, (tile.n, tile.k))
            tma_u, g_u = cpasync.make_tiled_tma_atom(load, m_u, b_one, (tile.n, tile.k))
            tma_out, g_out = cpasync.make_tiled_tma_atom(
                store, m_out, cute.slice_(this.epi_smem, (None, None, 0)), this.epi_tile)
            if cutlass.const_expr(shrink):
                # An S tile is A's ranks (zero past R) times tile.n tokens of x: A streams as
                # the M operand, x as the N operand, S^T stored into S's memory.
                m_a = cute.make_tensor(a_ptr, cute.make_layout((r, k), stride=(k, 1)))
                m_st = cute.make_tensor(s_ptr, cute.make_layout((r, s_rows), stride=(1, r)))
                tma_a, g_a = cpasync.make_tiled_tma_atom(load, m_a, a_one, (tile.m, tile.k))
                tma_xn, g_xn = cpasync.make_tiled_tma_atom(load, m_x, b_one, (tile.n, tile.k))
                tma_st, g_st = cpasync.make_tiled_tma_atom(
                    store, m_st, cute.slice_(this.epi_smem_t, (None, None, 0)), this.epi_tile)
            else:
                tma_a, g_a, tma_xn, g_xn, tma_st, g_st = (tma_x, g_x, tma_w, g_w, tma_out,
                                                          g_out)

            # One unit per output tile (and per S tile), walked in order by a static
            # persistent scheduler: consecutive CTAs take consecutive column tiles of one row
            # block (x's rows read from memory once; W, re-read per row block, stays in L2).
            sched = utils.PersistentTileSchedulerParams((units, 1, 1), (1, 1, 1), 1, False)
            grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, this.sms)

            @cute.struct
            class Shared:
                barriers: cute.struct.MemRange[cutlass.Int64, this.stages * 2]
                a: cute.struct.Align[cute.struct.MemRange[elem, cute.cosize(this.a_smem)],
                                     _SMEM_ALIGN]
                b: cute.struct.Align[cute.struct.MemRange[elem, cute.cosize(this.b_smem)],
                                     _SMEM_ALIGN]
                out: cute.struct.Align[
                    cute.struct.MemRange[elem, max(cute.cosize(this.epi_smem),
                                                   cute.cosize(this.epi_smem_t))],
                    _SMEM_ALIGN]

            this.shared = Shared
            kernel(this.mma, tma_x, g_x, tma_w, g_w, tma_s, g_s, tma_u, g_u, tma_out, g_out,
                   tma_a, g_a, tma_xn, g_xn, tma_st, g_st, m_bias, m_scale, m_table, m_flags,
                   this.a_smem, this.b_smem, this.epi_smem, this.epi_smem_t, sched, t, n, k,
                   r).launch(grid=grid, block=[this.threads, 1, 1], cluster=(1, 1, 1),
                             min_blocks_per_mp=1, stream=stream, use_pdl=this.pdl)

        return launch


@functools.cache
def compile_lora_gemm(dtype: torch.dtype, tile: CuteTile, has_bias: bool, sms: int,
                      options: str = "", shrink: bool = False, pdl: bool = False) -> Any:
    """The compiled kernel for ``dtype`` operands, ``tile`` and ``sms`` persistent CTAs (once
    per process per arguments; compiling takes a second or two, a call microseconds); with
    ``shrink`` the program computes S itself (the module docstring). With ``pdl`` (S given
    only) it is launched as a programmatic dependent of the kernel before it, the one writing
    S: it starts while that kernel runs, streaming x and W, and its producer waits for that
    kernel's end before the first S tile (its consumers before reading the bias, whose
    refreshing copy may be that kernel). A call must then come right after the kernel writing
    S, with x and W in memory before that kernel started.

    Compiles for sm_90a with or without a GPU, so the CPU tests check that the program is well
    formed. ``options``: more of the DSL's compile options (``"--keep-ptx --dump-dir D"`` keeps
    the PTX in ``.artifacts.PTX`` and writes it under ``D``).
    """
    if dtype not in CUTE_DTYPES:
        raise TypeError(f"the CuTe LoRA kernel takes bfloat16 or float16 operands, not {dtype}")
    if pdl and shrink:
        raise ValueError("compile_lora_gemm: pdl waits for a kernel writing S; the shrink "
                         "form computes S itself (pass pdl=False)")
    d = dsl()
    cute, cutlass = d.cute, d.cutlass
    elem, f32, i32 = numeric(dtype), cutlass.Float32, cutlass.Int32
    ptr = functools.partial(d.make_ptr, value=0, mem_space=cute.AddressSpace.gmem,
                            assumed_align=16)
    kernel = _Kernel(dtype, tile, has_bias, sms, shrink, pdl)
    from cuda.bindings import driver

    pointers = (elem, elem, elem, elem, elem, f32, f32, elem, i32, i32)  # x W A S B scale bias
    sizes = (1, 8, 8, 8, 1, 1)  # t, n, k, r, units, S tiles                    out table flags
    return cute.compile(kernel.host(), *(ptr(p) for p in pointers), *(i32(v) for v in sizes),
                        driver.CUstream(0), options=f"--gpu-arch sm_90a {options}".strip())
