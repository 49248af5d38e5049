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
shrink or not); :class:`~shuttle.kernels.lora_linear_cute.CuteLoraGemm` launches it for a layer.
"""

# No `from __future__ import annotations`: the DSL reads the jit functions' annotations as
# objects (cute.Tensor, cutlass.Int32), which live in closures, not in this module's globals.
import functools
from typing import Any

import torch

from shuttle.kernels.cute_dsl import CUTE_DTYPES, CUTE_TILES, CuteTile, dsl, numeric
from shuttle.kernels.lora_gemm_units import unit_of

__all__ = ["CUTE_SHRINK_MAX_RANK", "compile_lora_gemm"]


# The most ranks the kernel's own shrink takes: an S tile's ranks are its M rows.
CUTE_SHRINK_MAX_RANK = min(tile.m for tile in CUTE_TILES)
_THREADS_PER_WARPGROUP = 128
_EPI_STAGES = 4
_BARRIER_BYTES = 1024  # the pipeline's mbarriers, rounded up
_SMEM_ALIGN = 1024  # swizzled shared-memory buffers start on 1 KiB


def _stages(tile: CuteTile, epi_tile: tuple[int, int], elem_bytes: int, smem: int) -> int:
    """How many (A, B) tile pairs fit in shared memory beside the epilogue's buffers."""
    ab = (tile.m + tile.n) * tile.k * elem_bytes
    epi = epi_tile[0] * epi_tile[1] * elem_bytes * _EPI_STAGES
    return (smem - _BARRIER_BYTES - epi - 2 * _SMEM_ALIGN) // ab


class _Kernel:
    """The DSL program for one (dtype, tile, bias or not, SM count, shrink or not); see the
    module docstring.

    ``host`` builds the ``@cute.jit`` launcher (tensors from raw pointers, TMA descriptors,
    shared-memory layouts, the grid), ``device`` the ``@cute.kernel``; the layouts and the
    shared-storage struct built by the first are attributes the second reads.
    """

    def __init__(self, dtype: torch.dtype, tile: CuteTile, has_bias: bool, sms: int,
                 shrink: bool):
        self.dtype = dtype
        self.tile = tile
        self.has_bias = has_bias
        self.sms = sms
        self.shrink = shrink
        self.consumers = tile.consumers
        self.threads = (1 + self.consumers) * _THREADS_PER_WARPGROUP
        self.elem = numeric(dtype)

    def host(self) -> Any:
        """The ``@cute.jit`` launcher, built from pointers and sizes so a call converts nothing."""
        d = dsl()
        cutlass, cute, utils, sm90 = d.cutlass, d.cute, d.utils, d.sm90
        cpasync = cute.nvgpu.cpasync
        tile, consumers, elem, shrink = self.tile, self.consumers, self.elem, self.shrink
        layout_k = utils.LayoutEnum.ROW_MAJOR  # every operand K-major, out N-major
        kernel = self.device()
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
            # S tiles leave the accumulator transposed (ranks x tokens): stored M-major.
            this.epi_smem_t = sm90.make_smem_layout_epi(elem, utils.LayoutEnum.COL_MAJOR,
                                                        this.epi_tile, _EPI_STAGES)
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
                             min_blocks_per_mp=1, stream=stream)

        return launch

    def device(self) -> Any:
        """The ``@cute.kernel``: one producer warp, ``consumers`` MMA warpgroups."""
        d = dsl()
        cutlass, cute, pipeline, utils, sm90 = d.cutlass, d.cute, d.pipeline, d.utils, d.sm90
        cpasync, warpgroup = cute.nvgpu.cpasync, cute.nvgpu.warpgroup
        tile, consumers, has_bias, elem = self.tile, self.consumers, self.has_bias, self.elem
        shrink = self.shrink
        row_tiles = tile.n // tile.m  # row tiles per S tile
        consumer_threads = consumers * _THREADS_PER_WARPGROUP
        producer_warp = 0
        store_warp = 4  # the first warp of the first consumer warpgroup issues the stores
        this = self

        @cute.kernel
        def kernel(mma: cute.TiledMma, tma_x: cute.CopyAtom, g_x: cute.Tensor,
                   tma_w: cute.CopyAtom, g_w: cute.Tensor, tma_s: cute.CopyAtom,
                   g_s: cute.Tensor, tma_u: cute.CopyAtom, g_u: cute.Tensor,
                   tma_out: cute.CopyAtom, g_out: cute.Tensor, tma_a: cute.CopyAtom,
                   g_a: cute.Tensor, tma_xn: cute.CopyAtom, g_xn: cute.Tensor,
                   tma_st: cute.CopyAtom, g_st: cute.Tensor, m_bias: cute.Tensor,
                   m_scale: cute.Tensor, m_table: cute.Tensor, m_flags: cute.Tensor,
                   a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                   epi_smem: cute.ComposedLayout, epi_smem_t: cute.ComposedLayout,
                   sched_params: Any, t: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                   r: cutlass.Int32):
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()
            if warp == producer_warp:
                for atom in (tma_x, tma_w, tma_s, tma_u, tma_out):
                    cpasync.prefetch_descriptor(atom)
                if cutlass.const_expr(shrink):
                    for atom in (tma_a, tma_xn, tma_st):
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
            s_out_t = storage.out.get_tensor(epi_smem_t.outer, swizzle=epi_smem_t.inner)

            # (bM, bK, tiles M, tiles K) and (bN, bK, tiles N, tiles K) views per operand.
            t_x = cute.local_tile(g_x, (tile.m, tile.k), (None, None))
            t_s = cute.local_tile(g_s, (tile.m, tile.k), (None, None))
            t_a = cute.local_tile(g_a, (tile.m, tile.k), (None, None))
            t_w = cute.local_tile(g_w, (tile.n, tile.k), (None, None))
            t_u = cute.local_tile(g_u, (tile.n, tile.k), (None, None))
            t_xn = cute.local_tile(g_xn, (tile.n, tile.k), (None, None))
            t_out = cute.local_tile(g_out, (tile.m, tile.n), (None, None))
            t_st = cute.local_tile(g_st, (tile.m, tile.n), (None, None))
            t_bias = cute.local_tile(m_bias, (tile.m, tile.n), (None, None))
            t_scale = cute.local_tile(m_scale, (tile.m, tile.n), (None, None))
            one = cute.make_layout(1)
            sa = cute.group_modes(s_a, 0, 2)
            sb = cute.group_modes(s_b, 0, 2)

            def part(atom, smem, tiles):
                return cpasync.tma_partition(atom, 0, one, smem, cute.group_modes(tiles, 0, 2))

            x_smem, x_glob = part(tma_x, sa, t_x)
            s_smem, s_glob = part(tma_s, sa, t_s)
            a_smem_p, a_glob = part(tma_a, sa, t_a)
            w_smem, w_glob = part(tma_w, sb, t_w)
            u_smem, u_glob = part(tma_u, sb, t_u)
            xn_smem, xn_glob = part(tma_xn, sb, t_xn)
            k_tiles = (k + tile.k - 1) // tile.k
            r_tiles = (r + tile.k - 1) // tile.k
            m_blocks = (t + tile.m - 1) // tile.m
            tiles_n = (n + tile.n - 1) // tile.n
            s_blocks = (m_blocks + row_tiles - 1) // row_tiles

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
                # Producer: per unit, its K loop's tile pairs into the ring (an output tile's
                # x/W pairs, then its S/B pairs once its S tile is in memory; an S tile's A/x
                # pairs).
                tiles = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
                work = tiles.initial_work_tile_info()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     stages)
                while work.is_valid_tile:
                    is_s, tm, tn = unit_of(work.tile_idx[0], m_table, tiles_n, shrink)
                    steps = k_tiles + r_tiles
                    if is_s:
                        steps = k_tiles
                    # The loop stays written out: the DSL carries ``state`` through a loop
                    # only where the kernel's own body advances it (a helper breaks the IR).
                    for step in range(steps):
                        if cutlass.const_expr(shrink):  # noqa: SIM102 (the DSL's rule)
                            if step == k_tiles:
                                # Wait until the S tile holding these rows is in memory; the
                                # last of its readers resets its flags for the next launch.
                                if lane == 0:
                                    j = tm // row_tiles
                                    ready = (m_flags.iterator + j).llvm_ptr
                                    seen = (m_flags.iterator + s_blocks + j).llvm_ptr
                                    got = cutlass.Int32(0)
                                    while got == 0:
                                        got = cute.arch.load(ready, cutlass.Int32,
                                                             sem="acquire", scope="gpu")
                                    rows = m_blocks - j * row_tiles
                                    if rows > row_tiles:
                                        rows = row_tiles
                                    before = cute.arch.atomic_add(
                                        seen, cutlass.Int32(1), sem="relaxed", scope="gpu")
                                    if before == rows * tiles_n - 1:
                                        cute.arch.store(ready, cutlass.Int32(0))
                                        cute.arch.store(seen, cutlass.Int32(0))
                                cute.arch.sync_warp()
                                cute.arch.fence_proxy("async.global")
                        ring.producer_acquire(state)
                        bar = ring.producer_get_barrier(state)
                        at = state.index
                        if step < k_tiles:
                            if cutlass.const_expr(shrink):
                                if is_s:
                                    cute.copy(tma_a, a_glob[(None, 0, step)],
                                              a_smem_p[(None, at)], tma_bar_ptr=bar)
                                    cute.copy(tma_xn, xn_glob[(None, tn, step)],
                                              xn_smem[(None, at)], tma_bar_ptr=bar)
                                else:
                                    cute.copy(tma_x, x_glob[(None, tm, step)],
                                              x_smem[(None, at)], tma_bar_ptr=bar)
                                    cute.copy(tma_w, w_glob[(None, tn, step)],
                                              w_smem[(None, at)], tma_bar_ptr=bar)
                            else:
                                cute.copy(tma_x, x_glob[(None, tm, step)],
                                          x_smem[(None, at)], tma_bar_ptr=bar)
                                cute.copy(tma_w, w_glob[(None, tn, step)],
                                          w_smem[(None, at)], tma_bar_ptr=bar)
                        else:
                            cute.copy(tma_s, s_glob[(None, tm, step - k_tiles)],
                                      s_smem[(None, at)], tma_bar_ptr=bar)
                            cute.copy(tma_u, u_glob[(None, tn, step - k_tiles)],
                                      u_smem[(None, at)], tma_bar_ptr=bar)
                        ring.producer_commit(state)
                        state.advance()
                    tiles.advance_to_next_work()
                    work = tiles.get_current_work()
                ring.producer_tail(state)

            if warpgroup_idx > 0:
                # Consumers: wgmma over the unit's K loop, then the epilogue.
                cute.arch.warpgroup_reg_alloc(232)
                tiles = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
                work = tiles.initial_work_tile_info()
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                       stages)
                k_blocks = cute.size(frag_a, mode=[2])

                # Epilogue copies: accumulator registers -> shared (stmatrix) -> global (TMA);
                # an S tile's through the transposing stmatrix into an M-major buffer.
                thr_c = mma.get_slice(tidx - _THREADS_PER_WARPGROUP)
                r2s = cute.make_tiled_copy_S(
                    sm90.get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, elem, cutlass.Float32),
                    cute.make_tiled_copy_C_atom(
                        cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                                            elem), mma))
                thr_r2s = r2s.get_slice(tidx - _THREADS_PER_WARPGROUP)
                r2s_dst = thr_r2s.partition_D(s_out)
                r2s_acc = r2s.retile(acc)
                sub_shape = cute.shape(thr_r2s.partition_S(s_out))[:3]
                sub_f32 = cute.make_rmem_tensor(sub_shape, cutlass.Float32)
                sub_out = cute.make_rmem_tensor(sub_shape, elem)
                sub_size = cute.size(sub_f32)
                if cutlass.const_expr(shrink):
                    r2s_t = cute.make_tiled_copy_S(
                        sm90.get_smem_store_op(utils.LayoutEnum.COL_MAJOR, elem,
                                               cutlass.Float32),
                        cute.make_tiled_copy_C_atom(
                            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4),
                                                elem), mma))
                    thr_r2s_t = r2s_t.get_slice(tidx - _THREADS_PER_WARPGROUP)
                    r2s_dst_t = thr_r2s_t.partition_D(s_out_t)
                    r2s_acc_t = r2s_t.retile(acc)
                    sub_shape_t = cute.shape(thr_r2s_t.partition_S(s_out_t))[:3]
                    sub_f32_t = cute.make_rmem_tensor(sub_shape_t, cutlass.Float32)
                    sub_out_t = cute.make_rmem_tensor(sub_shape_t, elem)
                    sub_size_t = cute.size(sub_f32_t)
                else:  # never used: the DSL traces both sides of `if is_s`
                    r2s_t, r2s_dst_t, r2s_acc_t = r2s, r2s_dst, r2s_acc
                    sub_f32_t, sub_out_t, sub_size_t = sub_f32, sub_out, sub_size
                stores = pipeline.PipelineTmaStore.create(
                    num_stages=_EPI_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                             consumer_threads))
                epi_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=consumer_threads)
                out_sub = cute.zipped_divide(t_out[(None, None, 0, 0)], this.epi_tile)
                subs = cute.size(out_sub, mode=[1])
                sub_grid = out_sub.shape[1]
                sub_layout = cute.make_layout(sub_grid, stride=(sub_grid[1], 1))

                while work.is_valid_tile:
                    is_s, tm, tn = unit_of(work.tile_idx[0], m_table, tiles_n, shrink)
                    steps = k_tiles + r_tiles
                    if is_s:
                        steps = k_tiles
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

                    # Epilogue, one sub-tile at a time through a ring of _EPI_STAGES buffers:
                    # written out for each kind of unit (their copies' layouts differ, and the
                    # DSL takes no helper closing over the kernel's values in staged code).
                    done = tiles.num_tiles_executed * subs
                    if is_s:
                        # S^T = (A x^T) * scale (per rank: per row here), rounded once, stored
                        # transposed into S (T, R)
                        scale = thr_c.partition_C(t_scale[(None, None, 0, 0)])
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            acc[i] = acc[i] * scale[i]
                        smem_part, glob_part = cpasync.tma_partition(
                            tma_st, 0, one, cute.group_modes(s_out_t, 0, 2),
                            cute.zipped_divide(t_st[(None, None, 0, tn)], this.epi_tile))
                        for sub in cutlass.range_constexpr(subs):
                            for v in cutlass.range_constexpr(sub_size_t):
                                sub_f32_t[v] = r2s_acc_t[sub * sub_size_t + v]
                            sub_out_t.store(sub_f32_t.load().to(elem))
                            buf = (done + sub) % _EPI_STAGES
                            cute.copy(r2s_t, sub_out_t, r2s_dst_t[(None, None, None, buf)])
                            cute.arch.fence_proxy("async.shared", space="cta")
                            epi_sync.arrive_and_wait()
                            if warp == store_warp:
                                cute.copy(tma_st, smem_part[(None, buf)],
                                          glob_part[(None, sub_layout.get_hier_coord(sub))])
                                stores.producer_commit()
                                stores.producer_acquire()
                            epi_sync.arrive_and_wait()
                        if warp == store_warp:
                            # S in memory (each lane's stores complete, not only read) before
                            # its flag tells the readers' TMA loads
                            cute.arch.cp_async_bulk_wait_group(0, read=False)
                            cute.arch.fence_proxy("async.global")
                            cute.arch.sync_warp()
                            if lane == 0:
                                cute.arch.atomic_add((m_flags.iterator + tn).llvm_ptr,
                                                     cutlass.Int32(1), sem="release",
                                                     scope="gpu")
                    else:
                        if cutlass.const_expr(has_bias):
                            # this thread's accumulator elements: the slice of its own thread
                            # (thr_mma is the warpgroup's, right for shared-memory operands
                            # only)
                            bias = thr_c.partition_C(t_bias[(None, None, tm, tn)])
                            for i in cutlass.range_constexpr(cute.size(acc)):
                                acc[i] = acc[i] + bias[i]
                        smem_part, glob_part = cpasync.tma_partition(
                            tma_out, 0, one, cute.group_modes(s_out, 0, 2),
                            cute.zipped_divide(t_out[(None, None, tm, tn)], this.epi_tile))
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
                      options: str = "", shrink: bool = False) -> Any:
    """The compiled kernel for ``dtype`` operands, ``tile`` and ``sms`` persistent CTAs (once
    per process per arguments; compiling takes a second or two, a call microseconds); with
    ``shrink`` the program computes S itself (the module docstring).

    Compiles for sm_90a with or without a GPU, so the CPU tests check that the program is well
    formed. ``options``: more of the DSL's compile options (``"--keep-ptx --dump-dir D"`` keeps
    the PTX in ``.artifacts.PTX`` and writes it under ``D``).
    """
    if dtype not in CUTE_DTYPES:
        raise TypeError(f"the CuTe LoRA kernel takes bfloat16 or float16 operands, not {dtype}")
    d = dsl()
    cute, cutlass = d.cute, d.cutlass
    elem, f32, i32 = numeric(dtype), cutlass.Float32, cutlass.Int32
    ptr = functools.partial(d.make_ptr, value=0, mem_space=cute.AddressSpace.gmem,
                            assumed_align=16)
    kernel = _Kernel(dtype, tile, has_bias, sms, shrink)
    from cuda.bindings import driver

    pointers = (elem, elem, elem, elem, elem, f32, f32, elem, i32, i32)  # x W A S B scale bias
    sizes = (1, 8, 8, 8, 1, 1)  # t, n, k, r, units, S tiles                    out table flags
    return cute.compile(kernel.host(), *(ptr(p) for p in pointers), *(i32(v) for v in sizes),
                        driver.CUstream(0), options=f"--gpu-arch sm_90a {options}".strip())
