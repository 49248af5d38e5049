"""The fused LoRA linear's GEMM for Hopper (sm_90), a CuTe-DSL program.

For x (T, K), W (N, K), S (T, R) (the shrink's output, ``(x @ A.T) * scale`` already scaled and
rounded to x's dtype) and B (N, R), one kernel computes::

    out = [x | S] @ [W | B].T + bias        # (T, N), float32 accumulator, rounded once

that is, the base GEMM with its K loop extended by the rank: the producer warp streams
``cdiv(K, BK)`` tile pairs of x and W, then ``cdiv(R, BK)`` pairs of S and B, through the same
shared-memory pipeline (the zero fill of TMA past K or R makes the partial tiles exact), and the
consumer warpgroups never see the seam. At rank 128 over K = 1536 that is 8.3% more MMA work
than the base product.

The form is CUTLASS's Hopper persistent GEMM, expressed in the CuTe DSL (``nvidia-cutlass-dsl``,
the ``hopper`` extra): one producer warp issuing TMA bulk copies into a ring of ``stages``
buffers, one or two consumer warpgroups issuing ``wgmma`` out of shared memory, a static
persistent tile scheduler (one CTA per SM walking the output tiles, so one tile's epilogue
overlaps the next tile's loads), and a TMA-store epilogue through shared memory. The bias is
added to the float32 accumulator from a float32 copy padded to whole tiles (read without a
bound check).

:func:`compile_lora_gemm` compiles it once per (dtype, tile shape, bias or not, SM count);
:class:`~shuttle.kernels.lora_linear_cute.CuteLoraGemm` launches it for a layer.
"""

# No `from __future__ import annotations`: the DSL reads the jit functions' annotations as
# objects (cute.Tensor, cutlass.Int32), which live in closures, not in this module's globals.
import dataclasses
import functools
import importlib.util
import types
from typing import Any

import torch

__all__ = ["CUTE_DTYPES", "CUTE_TILES", "CuteTile", "compile_lora_gemm", "dsl", "numeric"]


@dataclasses.dataclass(frozen=True)
class CuteTile:
    """One CTA's output tile (``m`` x ``n``) and its K step; ``consumers`` warpgroups share the
    ``m`` rows, 64 each (a wgmma instruction's rows): one warpgroup over 128 rows would issue
    both halves' instructions in turn and hold both accumulators.
    """

    m: int = 128
    n: int = 256
    k: int = 64

    @property
    def consumers(self) -> int:
        return self.m // 64


# The tiles tried by the tier chooser: 128 x 256 fills the SMs' rounds at long sequences,
# 128 x 128 at shorter ones (the same trade as the Triton kernel's two configurations).
CUTE_TILES: tuple[CuteTile, ...] = (CuteTile(128, 256, 64), CuteTile(128, 128, 64))

CUTE_DTYPES = (torch.bfloat16, torch.float16)
_THREADS_PER_WARPGROUP = 128
_EPI_STAGES = 4
_BARRIER_BYTES = 1024  # the pipeline's mbarriers, rounded up
_SMEM_ALIGN = 1024  # swizzled shared-memory buffers start on 1 KiB


@functools.cache
def dsl() -> Any:
    """The DSL's modules, imported on first use (an optional dependency)."""
    from shuttle.optional import import_optional

    install = 'pip install "shuttle[hopper]"'
    # The wheel puts its packages on sys.path through a .pth file; an install with --target
    # (no site processing) needs the path added here.
    pkg = importlib.util.find_spec("nvidia_cutlass_dsl")
    if pkg is not None and importlib.util.find_spec("cutlass") is None:
        import os
        import sys

        for root in pkg.submodule_search_locations or ():
            sys.path.insert(0, os.path.join(root, "dsl_packages"))
    cutlass = import_optional("cutlass", "the CuTe fused LoRA kernel", install)
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.runtime import make_ptr

    return types.SimpleNamespace(cutlass=cutlass, cute=cute, pipeline=pipeline, utils=utils,
                                 sm90=sm90, make_ptr=make_ptr)


def numeric(dtype: torch.dtype) -> Any:
    """The DSL's element type for a torch dtype (bfloat16 or float16)."""
    cutlass = dsl().cutlass
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def _stages(tile: CuteTile, epi_tile: tuple[int, int], elem_bytes: int, smem: int) -> int:
    """How many (A, B) tile pairs fit in shared memory beside the epilogue's buffers."""
    ab = (tile.m + tile.n) * tile.k * elem_bytes
    epi = epi_tile[0] * epi_tile[1] * elem_bytes * _EPI_STAGES
    return (smem - _BARRIER_BYTES - epi - 2 * _SMEM_ALIGN) // ab


class _Kernel:
    """The DSL program for one (dtype, tile, bias or not, SM count); see the module docstring.

    ``__call__`` is the host-side ``@cute.jit`` function (tensors from raw pointers, TMA
    descriptors, shared-memory layouts, the grid), ``kernel`` the device function; the layouts
    and the shared-storage struct built by the first are attributes the second reads.
    """

    def __init__(self, dtype: torch.dtype, tile: CuteTile, has_bias: bool, sms: int):
        self.dtype = dtype
        self.tile = tile
        self.has_bias = has_bias
        self.sms = sms
        self.consumers = tile.consumers
        self.threads = (1 + self.consumers) * _THREADS_PER_WARPGROUP
        self.elem = numeric(dtype)

    def host(self) -> Any:
        """The ``@cute.jit`` launcher, built from pointers and sizes so a call converts nothing."""
        d = dsl()
        cutlass, cute, utils, sm90 = d.cutlass, d.cute, d.utils, d.sm90
        cpasync = cute.nvgpu.cpasync
        tile, consumers, elem = self.tile, self.consumers, self.elem
        layout_k = utils.LayoutEnum.ROW_MAJOR  # every operand K-major, out N-major
        kernel = self.device()
        this = self

        @cute.jit
        def launch(x_ptr: cute.Pointer, w_ptr: cute.Pointer, s_ptr: cute.Pointer,
                   u_ptr: cute.Pointer, bias_ptr: cute.Pointer, out_ptr: cute.Pointer,
                   t: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, r: cutlass.Int32,
                   stream: Any):
            # Row-major (K-major) operands: x (T, K), W (N, K), S (T, R), B (N, R); out (T, N).
            m_x = cute.make_tensor(x_ptr, cute.make_layout((t, k), stride=(k, 1)))
            m_w = cute.make_tensor(w_ptr, cute.make_layout((n, k), stride=(k, 1)))
            m_s = cute.make_tensor(s_ptr, cute.make_layout((t, r), stride=(r, 1)))
            m_u = cute.make_tensor(u_ptr, cute.make_layout((n, r), stride=(r, 1)))
            m_out = cute.make_tensor(out_ptr, cute.make_layout((t, n), stride=(n, 1)))
            # The float32 bias, broadcast over rows (stride 0), padded to whole column tiles.
            m_bias = cute.make_tensor(bias_ptr, cute.make_layout((t, n), stride=(0, 1)))

            this.mma = sm90.make_trivial_tiled_mma(
                elem, elem, layout_k.sm90_mma_major_mode(), layout_k.sm90_mma_major_mode(),
                cutlass.Float32, (consumers, 1, 1), tiler_mn=(64, tile.n))
            tile_mnk = (tile.m, tile.n, tile.k)
            this.epi_tile = sm90.compute_tile_shape_or_override(
                tile_mnk, elem, is_cooperative=consumers == 2)
            this.stages = _stages(tile, this.epi_tile, this.dtype.itemsize,
                                  utils.get_smem_capacity_in_bytes("sm_90"))
            this.a_smem = sm90.make_smem_layout_a(layout_k, tile_mnk, elem, this.stages)
            this.b_smem = sm90.make_smem_layout_b(layout_k, tile_mnk, elem, this.stages)
            this.epi_smem = sm90.make_smem_layout_epi(elem, layout_k, this.epi_tile,
                                                      _EPI_STAGES)
            a_one = cute.slice_(this.a_smem, (None, None, 0))
            b_one = cute.slice_(this.b_smem, (None, None, 0))
            load = cpasync.CopyBulkTensorTileG2SOp()
            tma_x, g_x = cpasync.make_tiled_tma_atom(load, m_x, a_one, (tile.m, tile.k))
            tma_s, g_s = cpasync.make_tiled_tma_atom(load, m_s, a_one, (tile.m, tile.k))
            tma_w, g_w = cpasync.make_tiled_tma_atom(load, m_w, b_one, (tile.n, tile.k))
            tma_u, g_u = cpasync.make_tiled_tma_atom(load, m_u, b_one, (tile.n, tile.k))
            tma_out, g_out = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), m_out,
                cute.slice_(this.epi_smem, (None, None, 0)), this.epi_tile)

            tiles = cute.zipped_divide(m_out, tiler=(tile.m, tile.n))
            tiles_mn = tiles[(0, (None, None))].shape
            # Consecutive CTAs take consecutive column tiles of one row block: the row block of
            # x is read from memory once and W, re-read per row block, stays in L2.
            sched = utils.PersistentTileSchedulerParams((*tiles_mn, 1), (1, 1, 1), 1, False)
            grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, this.sms)

            @cute.struct
            class Shared:
                barriers: cute.struct.MemRange[cutlass.Int64, this.stages * 2]
                a: cute.struct.Align[cute.struct.MemRange[elem, cute.cosize(this.a_smem)],
                                     _SMEM_ALIGN]
                b: cute.struct.Align[cute.struct.MemRange[elem, cute.cosize(this.b_smem)],
                                     _SMEM_ALIGN]
                out: cute.struct.Align[
                    cute.struct.MemRange[elem, cute.cosize(this.epi_smem)], _SMEM_ALIGN]

            this.shared = Shared
            kernel(this.mma, tma_x, g_x, tma_w, g_w, tma_s, g_s, tma_u, g_u, tma_out, g_out,
                   m_bias, this.a_smem, this.b_smem, this.epi_smem, sched, k, r).launch(
                grid=grid, block=[this.threads, 1, 1], cluster=(1, 1, 1),
                min_blocks_per_mp=1, stream=stream)

        return launch

    def device(self) -> Any:
        """The ``@cute.kernel``: one producer warp, ``consumers`` MMA warpgroups."""
        d = dsl()
        cutlass, cute, pipeline, utils, sm90 = d.cutlass, d.cute, d.pipeline, d.utils, d.sm90
        cpasync, warpgroup = cute.nvgpu.cpasync, cute.nvgpu.warpgroup
        tile, consumers, has_bias, elem = self.tile, self.consumers, self.has_bias, self.elem
        consumer_threads = consumers * _THREADS_PER_WARPGROUP
        producer_warp = 0
        store_warp = 4  # the first warp of the first consumer warpgroup issues the stores
        this = self

        @cute.kernel
        def kernel(mma: cute.TiledMma, tma_x: cute.CopyAtom, g_x: cute.Tensor,
                   tma_w: cute.CopyAtom, g_w: cute.Tensor, tma_s: cute.CopyAtom,
                   g_s: cute.Tensor, tma_u: cute.CopyAtom, g_u: cute.Tensor,
                   tma_out: cute.CopyAtom, g_out: cute.Tensor, m_bias: cute.Tensor,
                   a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                   epi_smem: cute.ComposedLayout, sched_params: Any, k: cutlass.Int32,
                   r: cutlass.Int32):
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp == producer_warp:
                for atom in (tma_x, tma_w, tma_s, tma_u, tma_out):
                    cpasync.prefetch_descriptor(atom)

            stages = this.stages
            a_one = cute.slice_(a_smem, (None, None, 0))
            b_one = cute.slice_(b_smem, (None, None, 0))
            tx_bytes = cute.size_in_bytes(elem, a_one) + cute.size_in_bytes(elem, b_one)

            storage = utils.SmemAllocator().allocate(this.shared)
            # Full/empty barriers per stage: the producer's TMA bytes fill a stage, each
            # consumer warp's release empties it.
            ring = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         consumers * 4),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            s_a = storage.a.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            s_b = storage.b.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            s_out = storage.out.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)

            # (bM, bK, tiles M, tiles K) and (bN, bK, tiles N, tiles K) views per operand.
            t_x = cute.local_tile(g_x, (tile.m, tile.k), (None, None))
            t_s = cute.local_tile(g_s, (tile.m, tile.k), (None, None))
            t_w = cute.local_tile(g_w, (tile.n, tile.k), (None, None))
            t_u = cute.local_tile(g_u, (tile.n, tile.k), (None, None))
            t_out = cute.local_tile(g_out, (tile.m, tile.n), (None, None))
            t_bias = cute.local_tile(m_bias, (tile.m, tile.n), (None, None))
            one = cute.make_layout(1)
            sa = cute.group_modes(s_a, 0, 2)
            sb = cute.group_modes(s_b, 0, 2)
            x_smem, x_glob = cpasync.tma_partition(tma_x, 0, one, sa,
                                                   cute.group_modes(t_x, 0, 2))
            s_smem, s_glob = cpasync.tma_partition(tma_s, 0, one, sa,
                                                   cute.group_modes(t_s, 0, 2))
            w_smem, w_glob = cpasync.tma_partition(tma_w, 0, one, sb,
                                                   cute.group_modes(t_w, 0, 2))
            u_smem, u_glob = cpasync.tma_partition(tma_u, 0, one, sb,
                                                   cute.group_modes(t_u, 0, 2))
            k_tiles = (k + tile.k - 1) // tile.k
            r_tiles = (r + tile.k - 1) // tile.k

            warpgroup_idx = cute.arch.make_warp_uniform(tidx // _THREADS_PER_WARPGROUP)
            thr_mma = mma.get_slice(
                cute.make_layout(consumers, stride=_THREADS_PER_WARPGROUP)(
                    warpgroup_idx - 1))
            frag_a = mma.make_fragment_A(thr_mma.partition_A(s_a))
            frag_b = mma.make_fragment_B(thr_mma.partition_B(s_b))
            acc_shape = thr_mma.partition_C(t_out[(None, None, 0, 0)]).shape
            acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            cute.arch.sync_threads()  # the barriers initialized before anyone waits on them

            if warpgroup_idx == 0:
                cute.arch.warpgroup_reg_dealloc(40)
            if warp == producer_warp:
                # Producer: per output tile, the x/W pairs then the S/B pairs into the ring.
                tiles = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
                work = tiles.initial_work_tile_info()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     stages)
                while work.is_valid_tile:
                    tm, tn = work.tile_idx[0], work.tile_idx[1]
                    # The two loops stay written out: the DSL carries ``state`` through a loop
                    # only where the kernel's own body advances it (a helper breaks the IR).
                    for kt in range(k_tiles):
                        ring.producer_acquire(state)
                        bar = ring.producer_get_barrier(state)
                        cute.copy(tma_x, x_glob[(None, tm, kt)], x_smem[(None, state.index)],
                                  tma_bar_ptr=bar)
                        cute.copy(tma_w, w_glob[(None, tn, kt)], w_smem[(None, state.index)],
                                  tma_bar_ptr=bar)
                        ring.producer_commit(state)
                        state.advance()
                    for rt in range(r_tiles):
                        ring.producer_acquire(state)
                        bar = ring.producer_get_barrier(state)
                        cute.copy(tma_s, s_glob[(None, tm, rt)], s_smem[(None, state.index)],
                                  tma_bar_ptr=bar)
                        cute.copy(tma_u, u_glob[(None, tn, rt)], u_smem[(None, state.index)],
                                  tma_bar_ptr=bar)
                        ring.producer_commit(state)
                        state.advance()
                    tiles.advance_to_next_work()
                    work = tiles.get_current_work()
                ring.producer_tail(state)

            if warpgroup_idx > 0:
                # Consumers: wgmma over the whole extended K loop, then the epilogue.
                cute.arch.warpgroup_reg_alloc(232)
                tiles = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
                work = tiles.initial_work_tile_info()
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                       stages)
                k_blocks = cute.size(frag_a, mode=[2])
                steps = k_tiles + r_tiles

                # Epilogue copies: accumulator registers -> shared (stmatrix) -> global (TMA).
                r2s = cute.make_tiled_copy_S(
                    sm90.get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, elem, cutlass.Float32),
                    cute.make_tiled_copy_C_atom(
                        cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                                            elem), mma))
                thr_r2s = r2s.get_slice(tidx - _THREADS_PER_WARPGROUP)
                thr_c = mma.get_slice(tidx - _THREADS_PER_WARPGROUP)
                r2s_dst = thr_r2s.partition_D(s_out)
                r2s_acc = r2s.retile(acc)
                sub_shape = cute.shape(thr_r2s.partition_S(s_out))[:3]
                sub_f32 = cute.make_rmem_tensor(sub_shape, cutlass.Float32)
                sub_out = cute.make_rmem_tensor(sub_shape, elem)
                sub_size = cute.size(sub_f32)
                stores = pipeline.PipelineTmaStore.create(
                    num_stages=_EPI_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                             consumer_threads))
                epi_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=consumer_threads)

                while work.is_valid_tile:
                    tm, tn = work.tile_idx[0], work.tile_idx[1]
                    read.reset_count()
                    release.reset_count()
                    acc.fill(0.0)
                    mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    # One wgmma group in flight: step i's stage is released once step i + 1's
                    # group is issued and step i's has completed.
                    for step in range(steps):
                        ring.consumer_wait(read)
                        for kb in cutlass.range_constexpr(k_blocks):
                            at = (None, None, kb, read.index)
                            cute.gemm(mma, acc, frag_a[at], frag_b[at], acc)
                        warpgroup.commit_group()
                        read.advance()
                        if step > 0:
                            warpgroup.wait_group(1)
                            ring.consumer_release(release)
                            release.advance()
                    warpgroup.wait_group(0)
                    if steps > 0:
                        ring.consumer_release(release)
                        release.advance()

                    if cutlass.const_expr(has_bias):
                        # this thread's accumulator elements: the slice of its own thread
                        # (thr_mma is the warpgroup's, right for shared-memory operands only)
                        bias = thr_c.partition_C(t_bias[(None, None, tm, tn)])
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            acc[i] = acc[i] + bias[i]

                    # Epilogue, one sub-tile at a time through a ring of _EPI_STAGES buffers.
                    out_tiles = cute.zipped_divide(t_out[(None, None, tm, tn)], this.epi_tile)
                    smem_part, glob_part = cpasync.tma_partition(
                        tma_out, 0, one, cute.group_modes(s_out, 0, 2), out_tiles)
                    subs = cute.size(out_tiles, mode=[1])
                    sub_grid = out_tiles.shape[1]
                    sub_layout = cute.make_layout(sub_grid, stride=(sub_grid[1], 1))
                    done = tiles.num_tiles_executed * subs
                    for sub in cutlass.range_constexpr(subs):
                        for v in cutlass.range_constexpr(sub_size):
                            sub_f32[v] = r2s_acc[sub * sub_size + v]
                        sub_out.store(sub_f32.load().to(elem))
                        buf = (done + sub) % _EPI_STAGES
                        cute.copy(r2s, sub_out, r2s_dst[(None, None, None, buf)])
                        # the stmatrix writes visible to the TMA store's async proxy
                        cute.arch.fence_proxy("async.shared", space="cta")
                        epi_sync.arrive_and_wait()
                        if warp == store_warp:
                            cute.copy(tma_out, smem_part[(None, buf)],
                                      glob_part[(None, sub_layout.get_hier_coord(sub))])
                            stores.producer_commit()
                            stores.producer_acquire()
                        epi_sync.arrive_and_wait()
                    tiles.advance_to_next_work()
                    work = tiles.get_current_work()
                stores.producer_tail()

        return kernel


@functools.cache
def compile_lora_gemm(dtype: torch.dtype, tile: CuteTile, has_bias: bool, sms: int,
                      options: str = "") -> Any:
    """The compiled kernel for ``dtype`` operands, ``tile`` and ``sms`` persistent CTAs (once
    per process per arguments; compiling takes a second or two, a call microseconds).

    Compiles for sm_90a with or without a GPU, so the CPU tests check that the program is well
    formed. ``options``: more of the DSL's compile options (``"--keep-ptx --dump-dir D"`` keeps
    the PTX in ``.artifacts.PTX`` and writes it under ``D``).
    """
    if dtype not in CUTE_DTYPES:
        raise TypeError(f"the CuTe LoRA kernel takes bfloat16 or float16 operands, not {dtype}")
    d = dsl()
    cute, cutlass = d.cute, d.cutlass
    elem = numeric(dtype)
    gmem = cute.AddressSpace.gmem
    ptr = functools.partial(d.make_ptr, value=0, mem_space=gmem, assumed_align=16)
    kernel = _Kernel(dtype, tile, has_bias, sms)
    from cuda.bindings import driver

    return cute.compile(
        kernel.host(), ptr(elem), ptr(elem), ptr(elem), ptr(elem), ptr(cutlass.Float32),
        ptr(elem), cutlass.Int32(1), cutlass.Int32(8), cutlass.Int32(8), cutlass.Int32(8),
        driver.CUstream(0), options=f"--gpu-arch sm_90a {options}".strip())
