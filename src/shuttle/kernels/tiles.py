"""Tile-level pieces the Triton kernels share.

This module imports Triton at the top: kernel builders import it inside their lazy
``_kernel()`` functions (Triton is optional) and bind the helpers their kernels call into their
own module's globals (:func:`bind_tiles`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shuttle.kernels.launch import interpreting

# Compiled, a float32 -> bfloat16 cast rounds to nearest even in one instruction (cvt.rn); the
# interpreter's cast truncates, so there the rounding is spelled out in integer ops. Fixed when
# this module is imported, as Triton fixes interpretation when it decorates a kernel.
_RNE_BY_HAND: tl.constexpr = tl.constexpr(interpreting())

try:  # grid dependency control (programmatic dependent launch, sm_90 on): Triton 3.3 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

__all__ = ["bind_tiles", "dependent_launch_available", "dot_over_k", "gather_partials",
           "hash_uniform", "lowrank_tile", "pick",
           "publish_partial", "release_dependents", "release_tickets", "round_bf16",
           "shrink_step", "store_partial", "store_rne", "take_ticket", "tile_of",
           "wait_for_primary"]


def dependent_launch_available() -> bool:
    """Whether this Triton has grid dependency control (:func:`wait_for_primary`)."""
    return gdc_wait is not None


def bind_tiles(namespace: dict, *names: str) -> None:
    """Bind the helpers ``names`` of this module into ``namespace``, a kernel module's globals.

    Triton resolves the functions a kernel calls among its module's globals: its interpreter
    re-executes each kernel's source with those globals only, so closure variables would not
    do.
    """
    for name in names:
        namespace[name] = globals()[name]


@triton.jit
def tile_of(pid, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """Program ``pid``'s (BM, BN) tile of an (M, N) matrix, tiles in row-major order:
    ``(rows, cols, row mask, column mask)``.
    """
    n_tiles = tl.cdiv(N, BN)
    rm = (pid // n_tiles) * BM + tl.arange(0, BM)
    rn = (pid % n_tiles) * BN + tl.arange(0, BN)
    return rm, rn, rm < M, rn < N


@triton.jit
def pick(values, j, G: tl.constexpr):
    """``values[j]`` of a tuple of ``G`` pointers, for a runtime ``j``: one select per slot,
    which keeps what Triton knows of every argument (16-byte aligned addresses), so loads
    through the result stay vectorized. Addresses read from a table in memory carry no such
    facts: a grouped merge that read them lost its vectorized loads and was much slower.
    """
    out = values[0]
    for i in tl.static_range(1, G):
        out = tl.where(j == i, values[i], out)
    return out


@triton.jit
def lowrank_tile(b_ptr, a_ptr, scales_ptr, rm, rn, mask_m, mask_n, stride_bm, stride_ar,
                 BM: tl.constexpr, BN: tl.constexpr, N_SEG: tl.constexpr, BR: tl.constexpr,
                 IEEE: tl.constexpr):
    """``sum_s scales[s] * b[rm, s*BR:(s+1)*BR] @ a[s*BR:(s+1)*BR, rn]``, (BM, BN) float32.

    b: (M, N_SEG * BR) and a: (N_SEG * BR, N): each contribution's factors zero-padded to BR
    ranks, so rank offsets are compile-time multiples of BR (aligned loads, no rank masks).
    """
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in tl.static_range(N_SEG):
        rk = s * BR + tl.arange(0, BR)
        b = tl.load(b_ptr + rm[:, None] * stride_bm + rk[None, :], mask=mask_m[:, None],
                    other=0.0)
        a = tl.load(a_ptr + rk[:, None] * stride_ar + rn[None, :], mask=mask_n[None, :],
                    other=0.0)
        if IEEE:  # float32 factors, or the interpreter (whose bf16 dot is wrong)
            part = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:  # bf16/fp16 products are exact in the float32 accumulator
            part = tl.dot(b, a)
        acc += part * tl.load(scales_ptr + s)
    return acc


@triton.jit
def dot_over_k(acc, a_ptrs, b_ptrs, rk, K, BK: tl.constexpr, EVEN_K: tl.constexpr,
               IEEE: tl.constexpr):
    """``acc + A @ B`` over an inner dimension of ``K`` elements, in steps of ``BK``.

    a_ptrs: (BM, BK) pointers to A's first K step and b_ptrs: (BK, BN) to B's, both with unit
    stride along K (each step moves them by BK); rk = ``tl.arange(0, BK)``. ``EVEN_K``: K is a
    multiple of BK (no masks). ``IEEE``: float32 dots (float32 or mixed operands, or the
    interpreter, whose bf16 dot is wrong); otherwise bf16/fp16 products, exact in the float32
    accumulator.
    """
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BK
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    return acc


@triton.jit
def round_bf16(x):
    """float32 -> bfloat16, rounded to nearest even on the GPU and under the interpreter alike
    (whose cast truncates: there the rounding is done by hand).
    """
    if _RNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits += ((bits >> 16) & 1) + 0x7FFF
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def _mix32(x):
    """A 32-bit integer hash with good avalanche (two multiply-xorshift rounds; constants
    from Chris Wellons' hash-prospector "lowbias32").
    """
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def hash_uniform(seed, idx):
    """A uniform float32 in [0, 1) (24 random bits) per element of int64 ``idx``, from a
    32-bit ``seed``: a pure function of (seed, idx), so the same on any tiling.

    For stochastic rounding, where only the distribution matters: four multiplies and a few
    shifts per element, against the ten Philox rounds of ``tl.rand`` (with which a float8
    merge's encode pass takes more than twice as long).
    """
    lo = idx.to(tl.uint32)
    hi = (idx >> 32).to(tl.uint32)
    x = _mix32(lo ^ _mix32(hi ^ tl.cast(seed, tl.uint32)))
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def store_rne(ptrs, x, mask):
    """Store float32 ``x`` at ``ptrs`` in their element type, rounded once to nearest even."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, round_bf16(x), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def shrink_step(h, x_ptr, d_ptr, rt, rr, kk, T, R, K, stride_xt, stride_dr,
                IEEE: tl.constexpr, ALIGNED: tl.constexpr):
    """``h + x[rt, kk] @ down[rr, kk].T``: one K step of a small shrink, (BT, BR) float32.

    Rows past T, ranks past R and K offsets past K load zeros. ALIGNED: rows of x and down
    start on 16 bytes and K is a multiple of 16 (the callers check it), told to the compiler
    on the pointer and mask tensors so that loads along K are 16-byte vectors.
    """
    x_ptrs = x_ptr + rt[:, None] * stride_xt + kk[None, :]
    d_ptrs = d_ptr + rr[None, :] * stride_dr + kk[:, None]
    x_mask = (rt[:, None] < T) & (kk[None, :] < K)
    d_mask = (rr[None, :] < R) & (kk[:, None] < K)
    if ALIGNED:
        x_ptrs = tl.multiple_of(x_ptrs, [16, 16])
        d_ptrs = tl.multiple_of(d_ptrs, [16, 16])
        x_mask = tl.max_constancy(x_mask, [1, 16])  # runs of 16 along K hold or fail alike
        d_mask = tl.max_constancy(d_mask, [16, 1])
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    d = tl.load(d_ptrs, mask=d_mask, other=0.0)
    if IEEE:  # the interpreter, whose bf16 dot is wrong
        return tl.dot(x.to(tl.float32), d.to(tl.float32), h, input_precision="ieee")
    return tl.dot(x, d, h)


# Split-K partials of a small shrink shared by one launch's programs. Program roles go by the
# order in which programs start (a ticket from sem[0]), not by program id: the first H_PARTS
# tickets compute one partial each and publish it (sem[1] counts them); the rest do their own
# work, then wait for all partials. A ticket is only ever held by a running program, so every
# wait ends whatever the hardware's scheduling order. The last program to finish (sem[2])
# resets the three counters for the next launch on the stream (launches on one stream do not
# overlap). The counters and the workspace: shuttle.kernels.semaphore.
@triton.jit
def take_ticket(sem_ptr):
    """This program's place in its launch's order of arrival."""
    return tl.atomic_add(sem_ptr, 1, sem="relaxed")


@triton.jit
def store_partial(part, x_ptr, d_ptr, ws_ptr, T, K, R, K_PER, stride_xt, stride_dr,
                  BT: tl.constexpr, BR: tl.constexpr, SK: tl.constexpr, IEEE: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """Store the float32 partial ``x[:, Kp] @ down[:, Kp].T`` over K range ``part`` (K_PER
    elements, whole SK steps) at ``ws[part]`` as a whole (BT, BR) tile: rows past T and ranks
    past R are zeros.
    """
    rt = tl.arange(0, BT)
    rr = tl.arange(0, BR)
    rk = tl.arange(0, SK)
    k0 = part * K_PER
    h = tl.zeros((BT, BR), dtype=tl.float32)
    for k in range(k0, tl.minimum(k0 + K_PER, K), SK):
        h = shrink_step(h, x_ptr, d_ptr, rt, rr, k + rk, T, R, K, stride_xt, stride_dr, IEEE,
                        ALIGNED)
    # a float32 workspace of whole tiles: rows start on 64 bytes
    tl.store(tl.multiple_of(ws_ptr + part * BT * BR + rt[:, None] * BR + rr[None, :],
                            [16, 16]), h)


@triton.jit
def publish_partial(part, x_ptr, d_ptr, ws_ptr, sem_ptr, T, K, R, K_PER, stride_xt, stride_dr,
                    BT: tl.constexpr, BR: tl.constexpr, SK: tl.constexpr, IEEE: tl.constexpr,
                    ALIGNED: tl.constexpr):
    """:func:`store_partial`, then count it published for the programs that gather."""
    store_partial(part, x_ptr, d_ptr, ws_ptr, T, K, R, K_PER, stride_xt, stride_dr, BT, BR, SK,
                  IEEE, ALIGNED)
    # Every thread's stores, then the count: a scalar atomic is one thread's, and the barrier
    # orders the other threads' stores before it.
    tl.debug_barrier()
    tl.atomic_add(sem_ptr + 1, 1, sem="release")


@triton.jit
def gather_partials(ws_ptr, sem_ptr, BT: tl.constexpr, BR: tl.constexpr,
                    H_PARTS: tl.constexpr):
    """(BT, BR) float32: the sum of the H_PARTS published partials, in part order (the same
    bits in every program and every run), once all are published.
    """
    done = tl.atomic_add(sem_ptr + 1, 0, sem="acquire")
    while done < H_PARTS:
        done = tl.atomic_add(sem_ptr + 1, 0, sem="acquire")
    tl.debug_barrier()  # every thread's loads after the acquire
    rt = tl.arange(0, BT)
    rr = tl.arange(0, BR)
    ws_ptrs = tl.multiple_of(ws_ptr + rt[:, None] * BR + rr[None, :], [16, 16])
    h = tl.load(ws_ptrs, cache_modifier=".cg")  # from L2: written by other programs
    for p in range(1, H_PARTS):
        h += tl.load(ws_ptrs + p * BT * BR, cache_modifier=".cg")
    return h


@triton.jit
def release_tickets(sem_ptr, n_waiting):
    """Called once by each of the ``n_waiting`` programs that gathered the partials, last:
    the last of them resets the counters (every ticket is taken and every partial read).
    """
    finished = tl.atomic_add(sem_ptr + 2, 1, sem="acq_rel")
    if finished == n_waiting - 1:
        tl.atomic_xchg(sem_ptr, 0)
        tl.atomic_xchg(sem_ptr + 1, 0)
        tl.atomic_xchg(sem_ptr + 2, 0)


# Programmatic dependent launch (sm_90 on): a kernel launched with ``launch_pdl=True`` may start
# while the kernel before it in the stream (its primary) still runs, once every program of the
# primary has let it (the first helper below) or ended. Until it calls wait_for_primary it may only
# read what was in memory before the primary started, and write nothing; after the wait it sees
# all of the primary's writes. A kernel launched the ordinary way waits for the primary's end.


@triton.jit
def release_dependents():
    """Let the next kernel, launched as a programmatic dependent, start (no effect otherwise)."""
    gdc_launch_dependents()


@triton.jit
def wait_for_primary():
    """Wait until the kernel before this one in the stream has ended, its writes visible (at
    once where this kernel was launched the ordinary way).
    """
    gdc_wait()
