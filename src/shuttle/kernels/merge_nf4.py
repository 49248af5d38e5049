"""Fused low-rank merge into a bitsandbytes 4-bit (NF4/FP4) weight, never a dense float32 copy.

The weight W (M, N) is stored as 4-bit indices into a 16-value ``code`` (two per byte, the
first of a pair in the high nibble) and one float32 ``absmax`` per block of ``blocksize``
consecutive values of the row-major flattened weight::

    W[b, j] = code[idx[b, j]] * absmax[b]

The merge computes, for every block, ``X = W + sum_i scale_i * up_i @ down_i`` in float32,
its new ``absmax' = max |X|``, and re-encodes ``v = clamp(X / absmax', -1, 1)`` to the nearest
code entry (or stochastically between the two neighbours, ``P(upper) = (v - lo) / (hi - lo)``,
so that the expected value is ``v``). This is ``Bnb4bitWeight.encode`` to the bit: a zero block
keeps absmax 0 and encodes 0 / 1 = 0; a value at a midpoint goes to the lower neighbour; a value
below the code's smallest entry or above its largest goes to that entry.

:func:`merge_4bit` is the Triton kernel for a non-nested weight whose rows hold whole blocks
(``N % blocksize == 0``): each program owns a (BM, BN) tile with BN a multiple of
``blocksize``, so it owns whole blocks and needs nothing from other programs. It reads the
packed bytes and the absmax once, writes them once, and the 4-bit weight never exists in any
wider form outside registers. :func:`merge_4bit_reference` is the same math in PyTorch for any
shape: the oracle it is tested against (on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch

from shuttle.kernels.launch import (
    cdiv,
    device_floats,
    interpreting,
    seed32,
    triton_available,
)
from shuttle.kernels.merge_lowrank import padded_factors

__all__ = ["CUDA_CONFIG", "CodeOrder", "code_order", "merge_4bit", "merge_4bit_reference"]


def merge_4bit_reference(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                         shape: tuple[int, ...], blocksize: int, up: torch.Tensor,
                         down: torch.Tensor, seg: list[int], scales: list[float], *,
                         rounding: Literal["nearest", "stochastic"] = "nearest",
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode(dequantize(W) + sum_i scale_i * up[:, seg_i] @ down[seg_i])`` in PyTorch.

    Args:
        packed: the 4-bit indices, two per byte (any dtype viewing the bytes, any shape).
        absmax: (ceil(numel / blocksize),) float32 per-block scale (not nested).
        code: (16,) the code the indices point into, any order.
        shape: the weight's logical shape; ``up @ down`` must have ``numel`` values.
        blocksize: values per block of the flattened weight.
        up: (M, R) and down: (R, N): the contributions' factors, concatenated along R.
        seg: rank offsets of the contributions, ``[0, r_1, ..., R]``.
        scales: each contribution's scale (strength x alpha / rank).
        rounding: ``"nearest"`` or ``"stochastic"`` (``torch.rand`` from a generator seeded
            with ``seed``: repeatable, but not the kernel's random stream).

    Returns:
        ``(packed, absmax)`` of the merged weight, with the dtypes and shapes of the inputs.
    """
    numel = torch.Size(shape).numel()
    b = packed.contiguous().view(torch.uint8).reshape(-1)
    idx = torch.stack([b >> 4, b & 0x0F], dim=1).reshape(-1)[:numel].long()
    x = _blocks(code.float()[idx], blocksize) * absmax.float().view(-1, 1)
    update = torch.zeros(up.shape[0], down.shape[1], dtype=torch.float32, device=up.device)
    for i, a in enumerate(scales):
        r0, r1 = seg[i], seg[i + 1]
        update.addmm_(up[:, r0:r1].float(), down[r0:r1].float(), alpha=a)
    x = _blocks(x.reshape(-1)[:numel] + update.reshape(-1), blocksize)  # (blocks, blocksize)
    new_absmax = x.abs().amax(dim=1)
    safe = torch.where(new_absmax > 0, new_absmax, torch.ones_like(new_absmax))
    v = (x / safe.view(-1, 1)).clamp(-1, 1).reshape(-1)[:numel]
    sorted_code, perm = code.float().sort()
    hi = torch.searchsorted(sorted_code, v.contiguous()).clamp(1, code.numel() - 1)
    lo = hi - 1
    v_lo, v_hi = sorted_code[lo], sorted_code[hi]
    if rounding == "nearest":
        take_hi = v - v_lo > v_hi - v
    else:
        gap = v_hi - v_lo
        p = torch.where(gap > 0, (v - v_lo) / torch.where(gap > 0, gap, 1.0), 0.0)
        g = torch.Generator(device=v.device).manual_seed(seed)
        take_hi = torch.rand(v.shape, generator=g, device=v.device) < p
    q = perm[torch.where(take_hi, hi, lo)].to(torch.uint8)
    q = torch.cat([q, q.new_zeros(2 * b.numel() - numel)]).view(-1, 2)  # zero pad bytes
    new_packed = ((q[:, 0] << 4) | q[:, 1]).view(packed.dtype).view(packed.shape)
    return new_packed, new_absmax.to(absmax.dtype)


def _blocks(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``x`` flattened and zero-padded to whole blocks: ``(blocks, blocksize)`` float32."""
    flat = x.reshape(-1).float()
    return torch.cat([flat, flat.new_zeros(-flat.numel() % blocksize)]).view(-1, blocksize)


# Shared tile helpers, bound by tiles.bind_tiles() when the kernels are built (see there).
hash_uniform = lowrank_tile = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "hash_uniform", "lowrank_tile")

    @triton.jit
    def merge_4bit_kernel(packed_ptr, absmax_ptr, code_ptr, sorted_ptr, perm_ptr, b_ptr, a_ptr,
                          scales_ptr, out_packed_ptr, out_absmax_ptr, M, N, stride_bm, stride_ar,
                          seed, N_SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BR: tl.constexpr, BS: tl.constexpr, STOCHASTIC: tl.constexpr,
                          IEEE: tl.constexpr):
        # One (BM, BN) tile of W per program; BN is a multiple of the blocksize BS and N of BS,
        # so the tile holds NB = BN / BS whole blocks per row, and a column tile past N masks
        # whole blocks. Factors as in merge_lowrank: contribution s owns ranks s*BR...(s+1)*BR.
        NB: tl.constexpr = BN // BS
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BN)
        pid_m, pid_n = pid // n_tiles, pid % n_tiles
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mask_m, mask_n = rm < M, rn < N
        # The tile's (BM, BN/2) bytes and (BM, NB) scales; int64 offsets, as the flat element
        # index of a large weight passes 2**31.
        rh = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        byte_offs = rm[:, None].to(tl.int64) * (N // 2) + rh[None, :]
        byte_mask = mask_m[:, None] & (rh < N // 2)[None, :]
        rb = pid_n * NB + tl.arange(0, NB)
        blk_offs = rm[:, None].to(tl.int64) * (N // BS) + rb[None, :]
        blk_mask = mask_m[:, None] & (rb < N // BS)[None, :]
        byte = tl.load(packed_ptr + byte_offs, mask=byte_mask, other=0)
        amax = tl.load(absmax_ptr + blk_offs, mask=blk_mask, other=0.0).to(tl.float32)

        acc = lowrank_tile(b_ptr, a_ptr, scales_ptr, rm, rn, mask_m, mask_n, stride_bm, stride_ar,
                           BM, BN, N_SEG, BR, IEEE)

        # (BM, BN/2, 2) -> (BM, BN): high nibble first, as the bytes are laid out.
        idx = tl.reshape(tl.join(byte >> 4, byte & 0x0F), (BM, BN)).to(tl.int32)
        w = tl.reshape(tl.load(code_ptr + idx), (BM, NB, BS)) * amax[:, :, None]
        x = w + tl.reshape(acc, (BM, NB, BS))
        new_amax = tl.max(tl.abs(x), axis=2)  # (BM, NB)
        safe = tl.where(new_amax > 0, new_amax, 1.0)
        # div_rn: IEEE division, as torch's; a plain `/` compiles to an approximate one on CUDA.
        v = tl.math.div_rn(x, safe[:, :, None])
        v = tl.reshape(tl.minimum(tl.maximum(v, -1.0), 1.0), (BM, BN))

        # torch.searchsorted(sorted_code, v).clamp(1, 15): the neighbours sorted[hi - 1] <= v
        # <= sorted[hi]; the clamp sends v outside the code's range to its end interval.
        hi = tl.zeros((BM, BN), dtype=tl.int32)
        for i in tl.static_range(16):
            hi += (tl.load(sorted_ptr + i) < v).to(tl.int32)
        hi = tl.minimum(tl.maximum(hi, 1), 15)
        lo = hi - 1
        v_lo = tl.load(sorted_ptr + lo)
        v_hi = tl.load(sorted_ptr + hi)
        if STOCHASTIC:
            # P(hi) = (v - v_lo) / gap, 0 for a zero gap (FP4's +0 and -0); the random stream
            # is keyed by the flat element index, so it does not depend on the tiling.
            gap = v_hi - v_lo
            p = tl.where(gap > 0, tl.math.div_rn(v - v_lo, tl.where(gap > 0, gap, 1.0)), 0.0)
            u = hash_uniform(seed, rm[:, None].to(tl.int64) * N + rn[None, :])
            take_hi = u < p
        else:
            take_hi = v - v_lo > v_hi - v  # a tie goes to the lower neighbour
        q = tl.load(perm_ptr + tl.where(take_hi, hi, lo)).to(tl.uint8)
        q_hi, q_lo = tl.split(tl.reshape(q, (BM, BN // 2, 2)))
        tl.store(out_packed_ptr + byte_offs, (q_hi << 4) | q_lo, mask=byte_mask)
        tl.store(out_absmax_ptr + blk_offs, new_amax, mask=blk_mask)

    return merge_4bit_kernel


# (BM, BN, num_warps) on CUDA, BN raised to the blocksize where that is larger: the fastest GPU
# time in benchmarks/quantized.py --sweep (NF4 12288x3072, blocksize 64, rank 64).
CUDA_CONFIG: tuple[int, int, int] = (16, 128, 4)
_INTERPRET_CONFIG: tuple[int, int, int] = (16, 64, 4)
_MAX_TILE = 8192  # values per tile: a larger blocksize gets fewer rows (at least 16, for tl.dot)


class CodeOrder(NamedTuple):
    """A 16-value code as the kernel reads it: ``values`` (float32), ``sorted`` (ascending,
    float32) and ``perm`` (int32: ``sorted[i] == values[perm[i]]``, for nearest-code search).
    """

    values: torch.Tensor
    sorted: torch.Tensor
    perm: torch.Tensor


def code_order(code: torch.Tensor) -> CodeOrder:
    """:class:`CodeOrder` of ``code``. A model's 4-bit weights share one code (bitsandbytes
    keeps one per device): callers that merge many weights compute this once per code and pass
    it to :func:`merge_4bit` (sorting per weight costs host time comparable to the kernel).
    """
    values = code.to(torch.float32, copy=True)  # never ``code`` itself: keyed by it, kept
    ordered, perm = values.sort()
    return CodeOrder(values, ordered, perm.to(torch.int32))


def merge_4bit(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
               shape: tuple[int, ...], blocksize: int, up: torch.Tensor, down: torch.Tensor,
               seg: list[int], scales: list[float], *,
               rounding: Literal["nearest", "stochastic"] = "nearest", seed: int = 0,
               config: tuple[int, int, int] | None = None, order: CodeOrder | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The merged 4-bit weight's ``(packed, absmax)``, by one Triton kernel; None where it
    cannot run.

    Computes what :func:`merge_4bit_reference` computes; nearest rounding gives the same
    result except where float32 summation order moves a value across a code midpoint (and
    a block's absmax may differ in its last bits). Stochastic rounding draws
    ``hash_uniform(seed, flat element index)``: unbiased, and the same draws on any tiling.

    Repeatable for the same inputs, seed and ``config``, bit for bit. Not bit-identical across
    tilings: ``tl.dot`` sums the low-rank products in float32 in an order that may follow the
    tile shape (under the interpreter NumPy's BLAS picks its kernel by shape; on AVX2 CPUs
    this moved 5 of 120 absmax by one ulp between ``(16, 64)`` and ``(32, 128)`` tiles). So
    another ``config`` may move a block's absmax by a few float32 ulps, and a code only where
    its value lies within that rounding of a code midpoint (nearest) or of its draw
    (stochastic). A fixed order would take the products off ``tl.dot``.

    Args:
        packed: the 4-bit indices, two per byte, high nibble first (any dtype viewing the
            bytes, any shape), in row-major order of the weight.
        absmax: (M * N / blocksize,) float32 per-block scale (not nested).
        code: (16,) the code, any order.
        shape: ``(M, N)``.
        blocksize: values per block; a power of two dividing N.
        up: (M, R) and down: (R, N): factors concatenated along R, one dtype.
        seg: rank offsets of the contributions, ``[0, r_1, ..., R]``.
        scales: each contribution's scale (strength x alpha / rank).
        rounding: ``"nearest"`` or ``"stochastic"``.
        seed: the stochastic rounding's seed, ``0 <= seed < 2**64``.
        config: ``(BM, BN, num_warps)`` to override :data:`CUDA_CONFIG` (BN a power of two;
            raised to ``blocksize``).
        order: ``code_order(code)``, when the caller keeps it across weights (default:
            computed here).

    Returns:
        New ``(packed, absmax)`` with the inputs' dtypes and shapes, or None: no Triton, the
        tensors are neither on CUDA nor interpreted (``TRITON_INTERPRET=1``), the weight is
        not 2-D, or ``N`` is not a multiple of a power-of-two ``blocksize`` (blocks would
        straddle rows, and a tile would not own its blocks).
    """
    if not triton_available() or not (packed.is_cuda or interpreting()) or len(shape) != 2:
        return None
    m, n = shape
    if blocksize < 2 or blocksize & (blocksize - 1) or n % blocksize:
        return None
    assert up.shape == (m, seg[-1]) and down.shape == (seg[-1], n), "factors must be (M, R), (R, N)"
    assert len(seg) == len(scales) + 1 and code.numel() == 16 and absmax.is_floating_point()

    interpret = interpreting()
    up_p, down_p, scales, br = padded_factors(up, down, seg, scales)
    bm, bn, warps = config or (_INTERPRET_CONFIG if interpret else CUDA_CONFIG)
    bn = max(bn, blocksize)
    bm = max(16, min(bm, _MAX_TILE // bn))
    order = order if order is not None else code_order(code)
    in_bytes = packed.contiguous().view(torch.uint8).reshape(-1)
    out_bytes = torch.empty_like(in_bytes)
    if in_bytes.numel() > m * n // 2:
        out_bytes[m * n // 2:].zero_()  # storage padding beyond the weight, as encode writes it
    out_absmax = torch.empty(m * n // blocksize, dtype=torch.float32, device=packed.device)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _kernel()[grid](
        in_bytes, absmax.contiguous(), order.values, order.sorted, order.perm, up_p,
        down_p, device_floats(scales, packed.device), out_bytes,
        out_absmax, m, n, up_p.stride(0), down_p.stride(0), seed32(seed), N_SEG=len(scales), BM=bm,
        BN=bn, BR=br, BS=blocksize, STOCHASTIC=rounding == "stochastic",
        IEEE=up.dtype == torch.float32 or interpret, num_warps=warps, num_stages=1)
    new_packed = out_bytes.view(packed.dtype).view(packed.shape)
    return new_packed, out_absmax.to(absmax.dtype)


