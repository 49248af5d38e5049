"""Decoding lossless-coded bfloat16/float16 weights: Huffman-coded high bits, raw low bits.

The code (built by :mod:`shuttle.weights.lossless`) splits every 16-bit value ``v`` into a
symbol, entropy coded, and a raw byte:

    bfloat16: symbol = exponent = (v >> 7) & 0xFF,  raw = sign << 7 | mantissa (7 bits)
    float16:  symbol = high byte = v >> 8,          raw = low byte = v & 0xFF

A tensor of ``n`` values is cut into groups of ``LANES * STEPS`` values; lane ``j`` of group
``g`` owns the values ``g*LANES*STEPS + i*LANES + j`` for ``i < STEPS`` (so the ``LANES``
lanes of a program read and write consecutive values at every step), and codes their symbols
in a bitstream of its own that starts on a 32-bit word: ``offsets[lane]`` (int32, one per lane
plus the end) is its first word in ``words`` (int32, most significant bit first, one zero word
of padding at the end). Codes are at most ``MAX_LEN`` bits; the table ``lut`` (int16,
``2**MAX_LEN`` entries) holds, for the next ``MAX_LEN`` bits ``peek``, ``symbol << 4 | length``
(length 0: no code starts with these bits) at :func:`table_index` ``(peek)``: the entries are
stored with the peek's low ``MAX_LEN - FIRST_BITS`` bits major, so that the first
``2**FIRST_BITS`` entries are the table of every code of at most ``FIRST_BITS`` bits (the entry
of ``peek`` with those low bits zero is the same code's when the code is that short). A
decoder may look there first, 512 bytes instead of 8 KiB of lines that a warp's lanes read at
random, and go to the whole table only for the longer (rare) codes.

Every group carries a check, ``sum((v_k + 1) * (2*r_k + 1)) mod 2**32`` over its values (``r``
the value's index in the group): one wrong value changes it by an odd multiple of a nonzero
difference below ``2**16``, so it is always caught. A decoder also checks that every lane
consumed exactly its words. Each group found wrong (a bad check, a lane over or under its
words, bits that start no code) adds one to ``errors[0]``: the caller raises, never the
kernel, so a decode queued on a side stream needs no host synchronization.

:func:`decode_exponents` runs a Triton kernel (CUDA, or the CPU interpreter) and
:func:`decode_exponents_reference` the same decode in PyTorch on any device. In the kernel each
lane keeps the next 33-64 bits of its stream in a 64-bit register and loads a word only when 32
or fewer are left (about one step in twelve at ~2.7 bits a code), so a warp's loads touch a few
cache lines a step instead of the ~22 that 32 lanes reading 32 streams ~90 bytes apart touch
when each reloads the words under its bit position (L1 wavefronts, not DRAM, bound such a
decoder). How a lane finds its code is the variant (:data:`DECODE_KERNELS`): ``"refill"`` (the
default, the faster where measured: docs/benchmarks/lossless.md) reads the whole table;
``"refill_first"`` reads its first ``2**FIRST_BITS`` entries (4 cache lines) and the whole
table only for lanes whose code is longer: fewer lines a step for more instructions, within a
few percent, so ``benchmarks/lossless.py --parts decode`` times both.
"""

from __future__ import annotations

import functools

import torch

from shuttle.kernels.launch import interpreting, triton_available

__all__ = ["DECODE_KERNELS", "DEFAULT_KERNEL", "FIRST_BITS", "LANES", "MAX_LEN", "STEPS",
           "decode_exponents", "decode_exponents_reference", "group_checks", "stored_table",
           "table_index"]

LANES = 128  # bitstreams decoded side by side by one program (one per thread)
STEPS = 256  # symbols per lane: a group is LANES * STEPS = 32768 values
MAX_LEN = 12  # longest code in bits: the lookup table has 4096 entries
FIRST_BITS = 8  # codes this short are found in the table's first 2**FIRST_BITS entries
GROUP = LANES * STEPS
_LOW = MAX_LEN - FIRST_BITS

_MASK32 = 0xFFFFFFFF


def _join(sym: torch.Tensor, raw: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The 16-bit values (in int32, 0..65535) of ``sym`` and ``raw`` (int32 tensors)."""
    if bf16:
        return ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
    return (sym << 8) | raw


def table_index(peek: torch.Tensor | int) -> torch.Tensor | int:
    """Where the entry of ``peek`` (the next ``MAX_LEN`` bits) lies in the stored table."""
    return ((peek & ((1 << _LOW) - 1)) << FIRST_BITS) | (peek >> _LOW)


def stored_table(lut: torch.Tensor) -> torch.Tensor:
    """The table as stored (:func:`table_index` order) from ``lut`` indexed by the peek."""
    return lut.view(1 << FIRST_BITS, 1 << _LOW).t().contiguous().view(-1)


def group_checks(values: torch.Tensor) -> torch.Tensor:
    """Each group's check of ``values`` (the 16-bit patterns, int32 in 0..65535, flat), as
    int32 (wrapped modulo ``2**32``).
    """
    n = values.numel()
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, dtype=torch.int64, device=values.device)
    padded[:n] = values.to(torch.int64) + 1
    weight = torch.arange(GROUP, dtype=torch.int64, device=values.device) * 2 + 1
    sums = (padded.view(groups, GROUP) * weight).sum(1) & _MASK32
    return torch.where(sums >= 2**31, sums - 2**32, sums).to(torch.int32)


def decode_exponents_reference(words: torch.Tensor, offsets: torch.Tensor, lut: torch.Tensor,
                               raw: torch.Tensor, checks: torch.Tensor, out: torch.Tensor,
                               errors: torch.Tensor, bf16: bool) -> None:
    """Decode into ``out`` (int16, ``n`` values, flat) in PyTorch; see the module docstring.

    Groups are decoded :data:`REFERENCE_GROUPS` at a time (each group's lanes read only their
    own words), so the temporaries (about 50 bytes a value) are one slice's, not the tensor's.

    Args:
        words: int32 code words (the last one padding).
        offsets: int32 first word of each lane, and the end: ``groups * LANES + 1`` entries.
        lut: int16 lookup table, ``2**MAX_LEN`` entries.
        raw: uint8 low bytes, ``n``.
        checks: int32 per group.
        out: int16 output, ``n`` values.
        errors: int32, one element: incremented once per group found wrong.
        bf16: the bfloat16 split (else float16's).
    """
    n, groups = out.numel(), checks.numel()
    top = words.numel() - 1
    for g0 in range(0, groups, REFERENCE_GROUPS):
        g1 = min(groups, g0 + REFERENCE_GROUPS)
        lanes = offsets[g0 * LANES:g1 * LANES + 1]
        # (clamped into the array: damaged offsets decode garbage that fails the checks)
        first = min(max(int(lanes[0]), 0), top)
        last = min(max(int(lanes[-1]), first), top)
        # the slice's words and one more (a lane's last window may read one word past its end;
        # those bits fall outside its codes)
        span = words[first:last + 1]
        lo, hi = g0 * GROUP, min(n, g1 * GROUP)
        _decode_groups(span, lanes - first, lut, raw[lo:hi], checks[g0:g1], out[lo:hi],
                       errors, bf16)


# Groups per slice of the reference decoder: 2**21 values, about 100 MB of temporaries.
REFERENCE_GROUPS = 64


def _decode_groups(words: torch.Tensor, offsets: torch.Tensor, lut: torch.Tensor,
                   raw: torch.Tensor, checks: torch.Tensor, out: torch.Tensor,
                   errors: torch.Tensor, bf16: bool) -> None:
    """:func:`decode_exponents_reference` over whole groups, ``words`` and ``offsets`` theirs."""
    n = out.numel()
    groups = checks.numel()
    lanes = groups * LANES
    w_all = words.to(torch.int64) & _MASK32
    table = lut.to(torch.int64)
    start = offsets[:lanes].to(torch.int64)
    end = offsets[1:lanes + 1].to(torch.int64)
    w, b = start.clone(), torch.zeros_like(start)
    index = (torch.arange(groups, device=out.device).view(groups, 1, 1) * GROUP
             + torch.arange(STEPS, device=out.device).view(1, STEPS, 1) * LANES
             + torch.arange(LANES, device=out.device).view(1, 1, LANES))  # (g, i, j)
    valid = index < n
    sym = torch.zeros(groups, STEPS, LANES, dtype=torch.int64, device=out.device)
    no_code = torch.zeros(lanes, dtype=torch.bool, device=out.device)
    top = w_all.numel() - 1
    for i in range(STEPS):
        ok = valid[:, i, :].reshape(lanes)
        # index_select: advanced indexing (w_all[w]) is ~100x slower on the CPU
        w0 = w_all.index_select(0, w.clamp(0, top))
        w1 = w_all.index_select(0, (w + 1).clamp(0, top))
        window = ((w0 << b) | ((w1 >> 1) >> (31 - b))) & _MASK32
        entry = table.index_select(0, table_index(window >> (32 - MAX_LEN)))
        length = torch.where(ok, entry & 15, 0)
        no_code |= ok & (length == 0)
        sym[:, i, :] = (entry >> 4).view(groups, LANES)
        b = b + length
        w = w + (b >> 5)
        b = b & 31
    lane_bad = no_code | ((w - start) + (b > 0).to(torch.int64) != end - start)
    flat_sym = sym.view(-1)[:groups * GROUP]
    order = index.view(-1)
    values = torch.zeros(groups * GROUP, dtype=torch.int64, device=out.device)
    values[order[order < n]] = flat_sym[order < n]
    v = _join(values[:n], raw.to(torch.int64), bf16)
    bad = (group_checks(v) != checks) | lane_bad.view(groups, LANES).any(1)
    errors += bad.sum().to(errors.dtype)
    out.copy_(torch.where(v >= 2**15, v - 2**16, v).to(torch.int16))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n", "n_words"])
    def decode_kernel(words_ptr, offsets_ptr, lut_ptr, raw_ptr, checks_ptr, out_ptr,
                             errors_ptr, n, n_words, BF16: tl.constexpr, LANES: tl.constexpr,
                             STEPS: tl.constexpr, MAX_LEN: tl.constexpr, FIRST: tl.constexpr,
                             TWO_LEVEL: tl.constexpr):
        g = tl.program_id(0)
        j = tl.arange(0, LANES)
        lane = g * LANES + j
        start = tl.load(offsets_ptr + lane)
        end = tl.load(offsets_ptr + lane + 1)
        # acc: the lane's next `have` bits, most significant first (33 <= have <= 64 before a
        # step's code is read). Word loads are masked to the array: a damaged offset or stream
        # reads zeros (and fails its checks), never past the end.
        in0 = (start >= 0) & (start < n_words)
        in1 = (start >= -1) & (start + 1 < n_words)
        hi = tl.load(words_ptr + start, mask=in0, other=0).to(tl.uint32, bitcast=True)
        lo = tl.load(words_ptr + start + 1, mask=in1, other=0).to(tl.uint32, bitcast=True)
        acc = (hi.to(tl.uint64) << 32) | lo.to(tl.uint64)
        w = start + 2
        have = tl.full([LANES], 64, tl.int32)
        bits = tl.zeros([LANES], dtype=tl.int32)  # consumed: at most STEPS * MAX_LEN
        check = tl.zeros([LANES], dtype=tl.int32)
        no_code = tl.zeros([LANES], dtype=tl.int32)
        base = g.to(tl.int64) * (LANES * STEPS)
        for i in range(STEPS):
            r = i * LANES + j
            k = base + r
            valid = k < n
            peek = (acc >> (64 - MAX_LEN)).to(tl.int32)
            at = ((peek & ((1 << (MAX_LEN - FIRST)) - 1)) << FIRST) | (peek >> (MAX_LEN - FIRST))
            if TWO_LEVEL:
                # the first 2**FIRST entries: the codes of at most FIRST bits; the whole table
                # only where the code is longer (or none starts here)
                entry = tl.load(lut_ptr + (peek >> (MAX_LEN - FIRST)), mask=valid,
                                other=0).to(tl.int32)
                longer = valid & (((entry & 15) > FIRST) | ((entry & 15) == 0))
                entry = tl.where(longer, tl.load(lut_ptr + at, mask=longer, other=0).to(tl.int32),
                                 entry)
            else:
                entry = tl.load(lut_ptr + at, mask=valid, other=0).to(tl.int32)
            length = tl.where(valid, entry & 15, 0)
            no_code = no_code | (valid & (length == 0)).to(tl.int32)
            sym = entry >> 4
            acc = acc << length.to(tl.uint64)
            have -= length
            bits += length
            need = have <= 32  # room for a whole word below the bits left
            nxt = tl.load(words_ptr + w, mask=need & (w >= 0) & (w < n_words),
                          other=0).to(tl.uint32, bitcast=True)
            acc = acc | (nxt.to(tl.uint64) << tl.where(need, 32 - have, 0).to(tl.uint64))
            have = tl.where(need, have + 32, have)
            w = tl.where(need, w + 1, w)
            low = tl.load(raw_ptr + k, mask=valid, other=0).to(tl.int32)
            if BF16:  # noqa: SIM108 (a constexpr branch: compiled once per dtype)
                v = ((low & 0x80) << 8) | (sym << 7) | (low & 0x7F)
            else:
                v = (sym << 8) | low
            tl.store(out_ptr + k, v.to(tl.int16), mask=valid)
            check += tl.where(valid, (v + 1) * (2 * r + 1), 0)  # int32: wraps mod 2**32
        lane_bad = (((bits + 31) >> 5) != end - start).to(tl.int32) | no_code
        total = tl.sum(check.to(tl.int64) & 0xFFFFFFFF) & 0xFFFFFFFF
        expected = tl.load(checks_ptr + g).to(tl.int64) & 0xFFFFFFFF
        wrong = (total != expected).to(tl.int32) + tl.max(lane_bad)
        tl.atomic_add(errors_ptr, tl.minimum(wrong, 1))

    return decode_kernel


# name -> the kernel's compile-time arguments: see the module docstring
DECODE_KERNELS = {"refill": {"TWO_LEVEL": False}, "refill_first": {"TWO_LEVEL": True}}
# the one decodes use: the faster of the two where measured (docs/benchmarks/lossless.md)
DEFAULT_KERNEL = "refill"


def decode_exponents(words: torch.Tensor, offsets: torch.Tensor, lut: torch.Tensor,
                     raw: torch.Tensor, checks: torch.Tensor, out: torch.Tensor,
                     errors: torch.Tensor, bf16: bool, kernel: str | None = None) -> None:
    """:func:`decode_exponents_reference`'s decode by a Triton kernel where it runs (CUDA
    tensors, or the CPU interpreter), else by the reference. Queued on the current stream;
    nothing is read back to the host.

    ``kernel``: a name in :data:`DECODE_KERNELS` (default :data:`DEFAULT_KERNEL`).
    """
    constexprs = DECODE_KERNELS[kernel or DEFAULT_KERNEL]
    if out.numel() == 0:
        return
    if not triton_available() or not (out.is_cuda or interpreting()):
        decode_exponents_reference(words, offsets, lut, raw, checks, out, errors, bf16)
        return
    _kernel()[(checks.numel(),)](words, offsets, lut, raw, checks, out, errors, out.numel(),
                                 words.numel(), BF16=bf16, LANES=LANES, STEPS=STEPS,
                                 MAX_LEN=MAX_LEN, FIRST=FIRST_BITS, **constexprs)
