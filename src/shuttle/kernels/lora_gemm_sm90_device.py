"""The device side of the fused LoRA linear's Hopper GEMM (:mod:`shuttle.kernels.lora_gemm_sm90`):
the ``@cute.kernel`` its launcher launches, one producer warp streaming tile pairs by TMA into a
ring of shared-memory stages and two consumer warpgroups issuing ``wgmma`` over each work unit
(:mod:`~shuttle.kernels.lora_gemm_units`), then its TMA-store epilogue.
"""

# No `from __future__ import annotations`: the DSL reads the kernel's annotations as objects
# (cute.Tensor, cutlass.Int32), which live in closures, not in this module's globals.
from typing import Any

from shuttle.kernels.cute_dsl import dsl
from shuttle.kernels.lora_gemm_units import unit_of

__all__ = ["EPI_STAGES", "THREADS_PER_WARPGROUP", "device_kernel"]

THREADS_PER_WARPGROUP = 128
EPI_STAGES = 4  # epilogue sub-tiles in flight through shared memory


def device_kernel(spec: Any) -> Any:
    """The ``@cute.kernel`` for ``spec`` (a :mod:`~shuttle.kernels.lora_gemm_sm90` program's
    dtype, tile, bias and shrink choices, and the layouts its launcher built): one producer
    warp, ``spec.consumers`` MMA warpgroups.
    """
    d = dsl()
    cutlass, cute, pipeline, utils, sm90 = d.cutlass, d.cute, d.pipeline, d.utils, d.sm90
    cpasync, warpgroup = cute.nvgpu.cpasync, cute.nvgpu.warpgroup
    tile, consumers, has_bias, elem = spec.tile, spec.consumers, spec.has_bias, spec.elem
    shrink, pingpong, pdl = spec.shrink, tile.pingpong, spec.pdl
    # The S tiles a row tile reads: one where an S tile's tokens (tile.n) are whole row tiles,
    # else up to two (a row tile straddling their boundary).
    spans = 1 if tile.n % tile.m == 0 else 2
    # The threads of one unit: both consumer warpgroups, or with ping-pong one of them.
    unit_threads = THREADS_PER_WARPGROUP * (1 if pingpong else consumers)
    producer_warp = 0
    this = spec

    @cute.jit
    def unit_steps(is_s: Any, k_tiles: Any, r_tiles: Any) -> Any:
        # the ring stages of a unit: an output tile's K and rank steps, an S tile's K steps
        steps = cutlass.Int32(k_tiles + r_tiles)
        if is_s:
            steps = cutlass.Int32(k_tiles)
        return steps

    @cute.jit
    def steps_of(work: Any, table: Any, last_unit: Any, tiles_n: Any, k_tiles: Any,
                 r_tiles: Any) -> Any:
        # the ring stages of ``work`` (none past the last unit)
        u = work.tile_idx[0]
        if u > last_unit:
            u = last_unit
        is_s, _, _ = unit_of(u, table, tiles_n, shrink)
        steps = unit_steps(is_s, k_tiles, r_tiles)
        if not work.is_valid_tile:
            steps = cutlass.Int32(0)
        return steps

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
                                                     unit_threads // 32),
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
        s_blocks = (m_blocks * tile.m + tile.n - 1) // tile.n

        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # a unit's thread index: from its first consumer thread (ping-pong: of its warpgroup)
        utid = (tidx - THREADS_PER_WARPGROUP) % unit_threads
        thr_mma = mma.get_slice(0 if pingpong else cute.make_layout(
            consumers, stride=THREADS_PER_WARPGROUP)(warpgroup_idx - 1))
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
                steps = unit_steps(is_s, k_tiles, r_tiles)
                # The loop stays written out: the DSL carries ``state`` through a loop
                # only where the kernel's own body advances it (a helper breaks the IR).
                for step in range(steps):
                    if cutlass.const_expr(shrink):  # noqa: SIM102 (the DSL's rule)
                        if step == k_tiles:
                            # Wait until the S tiles holding these rows are in memory;
                            # the last of an S tile's readers (the output tiles of every
                            # row tile it spans) resets its flags for the next launch.
                            if lane == 0:
                                for i in cutlass.range_constexpr(spans):
                                    j = tm * tile.m // tile.n + i
                                    if j * tile.n < (tm + 1) * tile.m:
                                        ready = (m_flags.iterator + j).llvm_ptr
                                        seen = (m_flags.iterator + s_blocks + j).llvm_ptr
                                        got = cutlass.Int32(0)
                                        while got == 0:
                                            got = cute.arch.load(ready, cutlass.Int32,
                                                                 sem="acquire", scope="gpu")
                                        last = (j * tile.n + tile.n - 1) // tile.m
                                        if last > m_blocks - 1:
                                            last = m_blocks - 1
                                        readers = (last - j * tile.n // tile.m + 1) * tiles_n
                                        before = cute.arch.atomic_add(
                                            seen, cutlass.Int32(1), sem="relaxed", scope="gpu")
                                        if before == readers - 1:
                                            cute.arch.store(ready, cutlass.Int32(0))
                                            cute.arch.store(seen, cutlass.Int32(0))
                            cute.arch.sync_warp()
                            cute.arch.fence_proxy("async.global")
                    if cutlass.const_expr(pdl):  # noqa: SIM102 (the DSL's rule)
                        # launched as the shrink's programmatic dependent: S once it ended
                        if step == k_tiles:
                            cute.arch.griddepcontrol_wait()
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
            me = warpgroup_idx - 1  # ping-pong: the second warpgroup takes the odd units
            is_store = warp == 4 + 4 * me if pingpong else warp == 4  # issues the stores
            last_unit = cute.size(m_table) - 1
            # Ping-pong turns (named barriers, both warpgroups' threads): main loops (ids 3,
            # 4) and epilogues (5, 6; they share the epilogue's buffers) alternate.
            turn_threads = 2 * THREADS_PER_WARPGROUP
            if cutlass.const_expr(pingpong):
                if me == 1:
                    # the first warpgroup goes first; the second skips its first unit's stages
                    pipeline.NamedBarrier(barrier_id=3, num_threads=turn_threads).arrive()
                    pipeline.NamedBarrier(barrier_id=5, num_threads=turn_threads).arrive()
                skip = me * steps_of(work, m_table, last_unit, tiles_n, k_tiles, r_tiles)
                read.advance(skip)
                release.advance(skip)
                tiles.advance_to_next_work(advance_count=me)
                work = tiles.get_current_work()

            # Epilogue copies: accumulator registers -> shared (stmatrix) -> global (TMA);
            # an S tile's through the transposing stmatrix into an M-major buffer.
            thr_c = mma.get_slice(utid)
            r2s = cute.make_tiled_copy_S(
                sm90.get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, elem, cutlass.Float32),
                cute.make_tiled_copy_C_atom(
                    cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                                        elem), mma))
            thr_r2s = r2s.get_slice(utid)
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
                thr_r2s_t = r2s_t.get_slice(utid)
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
                num_stages=EPI_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         unit_threads))
            epi_sync = pipeline.NamedBarrier(barrier_id=1 + me if pingpong else 1,
                                             num_threads=unit_threads)
            out_sub = cute.zipped_divide(t_out[(None, None, 0, 0)], this.epi_tile)
            subs = cute.size(out_sub, mode=[1])
            sub_grid = out_sub.shape[1]
            sub_layout = cute.make_layout(sub_grid, stride=(sub_grid[1], 1))

            while work.is_valid_tile:
                is_s, tm, tn = unit_of(work.tile_idx[0], m_table, tiles_n, shrink)
                steps = unit_steps(is_s, k_tiles, r_tiles)
                read.reset_count()
                release.reset_count()
                acc.fill(0.0)
                mma.set(warpgroup.Field.ACCUMULATE, True)
                if cutlass.const_expr(pingpong):  # this warpgroup's turn at the tensor cores
                    pipeline.NamedBarrier(barrier_id=3 + me,
                                          num_threads=turn_threads).arrive_and_wait()
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
                if cutlass.const_expr(pingpong):  # the other warpgroup's main loop may start
                    pipeline.NamedBarrier(barrier_id=4 - me, num_threads=turn_threads).arrive()
                warpgroup.wait_group(0)
                if steps > 0:
                    ring.consumer_release(release)
                    release.advance()
                if cutlass.const_expr(pingpong):
                    pipeline.NamedBarrier(barrier_id=5 + me,
                                          num_threads=turn_threads).arrive_and_wait()

                # Epilogue, one sub-tile at a time through a ring of EPI_STAGES buffers:
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
                        buf = (done + sub) % EPI_STAGES
                        cute.copy(r2s_t, sub_out_t, r2s_dst_t[(None, None, None, buf)])
                        cute.arch.fence_proxy("async.shared", space="cta")
                        epi_sync.arrive_and_wait()
                        if is_store:
                            cute.copy(tma_st, smem_part[(None, buf)],
                                      glob_part[(None, sub_layout.get_hier_coord(sub))])
                            stores.producer_commit()
                            stores.producer_acquire()
                        epi_sync.arrive_and_wait()
                    if is_store:
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
                        if cutlass.const_expr(pdl):  # the bias copy may be the kernel before
                            cute.arch.griddepcontrol_wait()
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
                        buf = (done + sub) % EPI_STAGES
                        cute.copy(r2s, sub_out, r2s_dst[(None, None, None, buf)])
                        # the stmatrix writes visible to the TMA store's async proxy
                        cute.arch.fence_proxy("async.shared", space="cta")
                        epi_sync.arrive_and_wait()
                        if is_store:
                            cute.copy(tma_out, smem_part[(None, buf)],
                                      glob_part[(None, sub_layout.get_hier_coord(sub))])
                            stores.producer_commit()
                            stores.producer_acquire()
                        epi_sync.arrive_and_wait()
                if cutlass.const_expr(pingpong):
                    # the buffers read by this epilogue's stores before the other's may write
                    if is_store:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    pipeline.NamedBarrier(barrier_id=6 - me, num_threads=turn_threads).arrive()
                tiles.advance_to_next_work()
                work = tiles.get_current_work()
                if cutlass.const_expr(pingpong):  # the other warpgroup's unit: its stages
                    skip = steps_of(work, m_table, last_unit, tiles_n, k_tiles, r_tiles)
                    read.advance(skip)
                    release.advance(skip)
                    tiles.advance_to_next_work()
                    work = tiles.get_current_work()
            stores.producer_tail()

    return kernel

