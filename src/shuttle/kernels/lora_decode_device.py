"""The decode kernels' device code (Triton): the update onto a base output (one launch whose
first programs compute split-K partials of ``h = x @ down.T`` for the rest:
``tiles.publish_partial`` / ``gather_partials``), and the whole layer's split-K shrink and
output kernel. Their host side, and what each computes: :mod:`shuttle.kernels.lora_decode`.
"""

from __future__ import annotations

import functools

from shuttle.kernels.launch import CompiledLaunch

__all__ = ["decode_kernels"]

# Shared tile helpers, bound by tiles.bind_tiles() when the kernels are built (see there).
gather_partials = publish_partial = release_dependents = release_tickets = None
store_partial = store_rne = take_ticket = wait_for_primary = None


@functools.cache
def decode_kernels() -> tuple[CompiledLaunch, CompiledLaunch, CompiledLaunch]:
    """The update kernel, the layer's output kernel and its partial shrink, compiled on first
    launch (per dtypes and constexprs) and launched through :class:`CompiledLaunch`.
    """
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "gather_partials", "publish_partial", "release_dependents",
               "release_tickets", "store_partial", "store_rne", "take_ticket", "wait_for_primary")

    # The kernels' runtime arguments are unspecialized: one binary per dtypes and constexprs,
    # launched from it by CompiledLaunch (at decode the host is the bottleneck, and Triton's
    # per-call dispatch is about half of a launch's host time). What specialization told the
    # compiler about alignment, ALIGNED tells it (the host's flags, lora_decode._aligned):
    # rows of x, of the weight or down factor and of the output start on 16 bytes and K, N are
    # multiples of 16, so loads along K and stores along N are 16-byte vectors (the hints go
    # on the pointer and mask tensors: Triton drops them on scalar arguments).
    @triton.jit(do_not_specialize=["x_ptr", "d_ptr", "u_ptr", "scale_ptr", "ws_ptr", "sem_ptr",
                                   "o_ptr", "T", "K", "N", "R", "K_PER", "n_out", "stride_xt",
                                   "stride_dr", "stride_un", "stride_ot"])
    def decode_kernel(x_ptr, d_ptr, u_ptr, scale_ptr, ws_ptr, sem_ptr, o_ptr, T, K, N, R, K_PER,
                      n_out, stride_xt, stride_dr, stride_un, stride_ot,
                      BT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, SK: tl.constexpr,
                      H_PARTS: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr,
                      UP_ALIGNED: tl.constexpr):
        # H_PARTS programs: partials of h over K ranges of SK steps; n_out programs:
        # out[:, rn] += (h * scale) @ up[rn].T over BN columns each, in float32 (h is never
        # rounded), rounded once.
        ticket = take_ticket(sem_ptr)
        if ticket < H_PARTS:
            publish_partial(ticket, x_ptr, d_ptr, ws_ptr, sem_ptr, T, K, R, K_PER, stride_xt,
                            stride_dr, BT, BR, SK, IEEE, ALIGNED)
        else:
            rt = tl.arange(0, BT)
            rr = tl.arange(0, BR)
            rn = (ticket - H_PARTS) * BN + tl.arange(0, BN)
            # what does not depend on h is loaded while the partials are computed
            u_ptrs = u_ptr + rn[None, :] * stride_un + rr[:, None]
            u_mask = (rr[:, None] < R) & (rn[None, :] < N)
            if UP_ALIGNED:  # rows of up start on 16 bytes and R is a multiple of 16
                u_ptrs = tl.multiple_of(u_ptrs, [16, 16])
                u_mask = tl.max_constancy(u_mask, [16, 1])
            u = tl.load(u_ptrs, mask=u_mask, other=0.0)
            mask = (rt[:, None] < T) & (rn[None, :] < N)
            o_ptrs = o_ptr + rt[:, None] * stride_ot + rn[None, :]
            if ALIGNED:  # N is a multiple of 16 too
                o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
                mask = tl.max_constancy(mask, [1, 16])
            o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
            scale = tl.load(scale_ptr + rr, mask=rr < R, other=0.0)
            h = gather_partials(ws_ptr, sem_ptr, BT, BR, H_PARTS) * scale[None, :]
            delta = tl.dot(h, u.to(tl.float32), input_precision="ieee")
            store_rne(o_ptrs, o + delta, mask)
            release_tickets(sem_ptr, n_out)

    @triton.jit(do_not_specialize=["x_ptr", "d_ptr", "ws_ptr", "T", "K", "R", "K_PER",
                                   "stride_xt", "stride_dr"])
    def partial_shrink_kernel(x_ptr, d_ptr, ws_ptr, T, K, R, K_PER, stride_xt, stride_dr,
                              BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                              IEEE: tl.constexpr, ALIGNED: tl.constexpr, PDL: tl.constexpr):
        # Program p: the float32 partial over its K range at ws[p] (padding rows and ranks
        # are zeros), in a workspace fresh for each launch. PDL: the output kernel follows as
        # a programmatic dependent, let it start streaming W now.
        if PDL:
            release_dependents()
        store_partial(tl.program_id(0), x_ptr, d_ptr, ws_ptr, T, K, R, K_PER, stride_xt,
                      stride_dr, BT, BR, BK, IEEE, ALIGNED)

    @triton.jit(do_not_specialize=["x_ptr", "w_ptr", "b_ptr", "u_ptr", "scale_ptr", "ws_ptr",
                                   "o_ptr", "T", "K", "N", "R", "stride_xt", "stride_wn",
                                   "stride_un", "stride_ot"])
    def linear_kernel(x_ptr, w_ptr, b_ptr, u_ptr, scale_ptr, ws_ptr, o_ptr, T, K, N, R,
                      stride_xt, stride_wn, stride_un, stride_ot,
                      BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                      H_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                      IEEE: tl.constexpr, ALIGNED: tl.constexpr, PDL: tl.constexpr):
        # acc = x @ W[rn].T over K, then h summed from partial_shrink_kernel's H_PARTS
        # partials in a fixed order (deterministic), acc += (h * scale) @ up[rn].T, + bias.
        # PDL: launched as the shrink's programmatic dependent, so W streams under the shrink
        # (x and W were in memory before it started); the partials are read after its end.
        rt = tl.arange(0, BT)
        rr = tl.arange(0, BR)
        rk = tl.arange(0, BK)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        # Rows of x past T are masked (no traffic: a wrapped row, as tiles.dot_over_k's callers
        # use, would be fetched again for every padding row, which made one token slower than
        # sixteen). Wrapped columns and ranks keep W and up loads in bounds without masks; the
        # scale (0 past R) and the store mask cancel what they add.
        row_ok = (rt < T)[:, None]
        rn_l = (rn % N).to(tl.int64)
        x_ptrs = x_ptr + rt[:, None] * stride_xt + rk[None, :]
        w_ptrs = w_ptr + rn_l[None, :] * stride_wn + rk[:, None]
        if ALIGNED:
            x_ptrs = tl.multiple_of(x_ptrs, [16, 16])
            w_ptrs = tl.multiple_of(w_ptrs, [16, 16])
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok, other=0.0)
                w = tl.load(w_ptrs)
            else:
                k_left = K - k * BK
                x_mask = row_ok & (rk[None, :] < k_left)
                w_mask = rk[:, None] < k_left
                if ALIGNED:  # K is a multiple of 16: the masks hold over runs of 16 along K
                    x_mask = tl.max_constancy(x_mask, [1, 16])
                    w_mask = tl.max_constancy(w_mask, [16, 1])
                x = tl.load(x_ptrs, mask=x_mask, other=0.0)
                w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if IEEE:  # the interpreter, whose bf16 dot is wrong
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            x_ptrs += BK
            w_ptrs += BK
        if PDL:
            wait_for_primary()
        ws_ptrs = tl.multiple_of(ws_ptr + rt[:, None] * BR + rr[None, :], [16, 16])
        h = tl.load(ws_ptrs)
        for p in range(1, H_PARTS):
            h += tl.load(ws_ptrs + p * BT * BR)
        h = h * tl.load(scale_ptr + rr, mask=rr < R, other=0.0)[None, :]
        u = tl.load(u_ptr + rn_l[None, :] * stride_un + (rr % R)[:, None])
        acc = tl.dot(h, u.to(tl.float32), acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_l).to(tl.float32)[None, :]
        mask = (rt[:, None] < T) & (rn[None, :] < N)
        o_ptrs = o_ptr + rt[:, None] * stride_ot + rn[None, :]
        if ALIGNED:  # N is a multiple of 16 too
            o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
            mask = tl.max_constancy(mask, [1, 16])
        store_rne(o_ptrs, acc, mask)

    return (CompiledLaunch(decode_kernel), CompiledLaunch(linear_kernel),
            CompiledLaunch(partial_shrink_kernel))
