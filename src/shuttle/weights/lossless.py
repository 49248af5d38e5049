"""Lossless-coded bfloat16/float16 weights: about 11 bits a value instead of 16, bit for bit.

A bfloat16 weight's 8 exponent bits carry about 2.6-3 bits of information (weights are near
Gaussian per tensor, so their magnitudes crowd into a few binades), while its sign and mantissa
are close to uniform. :class:`LosslessTensor` keeps the exponents Huffman coded (codes of at most
``MAX_LEN`` bits, decoded by one table lookup) and the sign and mantissa as one raw byte per
value; float16 codes its high byte and keeps the low one raw. The bit layout, the lanes that make
the decode parallel and the checks that catch a corrupt stream are those of
:mod:`shuttle.kernels.exponent_decode`.

Every bit pattern round-trips: zeros of both signs, subnormals, infinities and every NaN payload
are just symbols and raw bytes. A tensor whose code would not be smaller than its raw bytes is
not coded at all (:meth:`LosslessTensor.encode_tensor` returns None), so coding never costs more
than the raw bytes.

All of a tensor's parts live in one ``uint8`` buffer (``blob``), the one tensor the
representation declares: it is what host storage keeps, what a file stores, and what one copy
moves to the device, where :meth:`LosslessTensor.decode_into` decodes it.

Blob layout (each part starts on a 16-byte boundary, in this order):

    lut      int16[2**MAX_LEN]     symbol << 4 | code length, for the next MAX_LEN bits, in the
                                   order of ``exponent_decode.table_index`` (short codes first)
    checks   int32[groups]         per group of LANES * STEPS values
    offsets  int32[groups*LANES+1] first word of each lane's bitstream, then the end
    raw      uint8[n]              the low byte of each value (bfloat16: sign and mantissa)
    words    int32[words + 1]      the bitstreams, most significant bit first, then a zero word
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import heapq
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from shuttle.errors import CorruptCodeError, ShuttleError
from shuttle.kernels.exponent_decode import (
    GROUP,
    LANES,
    MAX_LEN,
    STEPS,
    decode_exponents,
    group_checks,
    stored_table,
)
from shuttle.kernels.rounding import Rounding, round_float
from shuttle.weights.representation import WeightRepresentation, register_representation

__all__ = ["CODED_DTYPES", "LosslessTensor", "code_lengths"]

CODED_DTYPES = (torch.bfloat16, torch.float16)
_ALIGN = 16
_CHUNK_GROUPS = 64  # groups encoded at once: bounds the encoder's scratch to ~100 MiB
# Values read per pass of the encoder (whole chunks): its temporaries (the 16-bit patterns as
# int32, symbols, raw bytes, int64 checks: about 40 bytes a value) are this slice's, not the
# tensor's, so a 1 GB embedding table codes in a few GB of host memory, not 20.
_SLICE = 4 * _CHUNK_GROUPS * GROUP


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Parts(NamedTuple):
    """Views of a blob's parts (see the module docstring)."""

    lut: torch.Tensor
    checks: torch.Tensor
    offsets: torch.Tensor
    raw: torch.Tensor
    words: torch.Tensor


def _part_spans(n: int, words: int) -> list[tuple[int, int, torch.dtype]]:
    """(byte offset, element count, dtype) of each part, and the blob size as the last offset."""
    groups = -(-n // GROUP)
    sizes = [(1 << MAX_LEN, torch.int16), (groups, torch.int32),
             (groups * LANES + 1, torch.int32), (n, torch.uint8), (words + 1, torch.int32)]
    spans, at = [], 0
    for count, dtype in sizes:
        spans.append((at, count, dtype))
        at = _up(at + count * dtype.itemsize)
    spans.append((at, 0, torch.uint8))
    return spans


def blob_nbytes(n: int, words: int) -> int:
    """Bytes of the blob of ``n`` values coded in ``words`` code words."""
    return _part_spans(n, words)[-1][0]


def code_lengths(counts: list[int], max_len: int = MAX_LEN) -> list[int]:
    """Huffman code lengths for symbol ``counts`` (0 for an absent symbol), none over
    ``max_len``: the optimal code, then lengths over the limit moved up the tree (each pair of
    longest codes becomes one code a level up, paying with a shorter code split in two), and
    the lengths dealt out again, shortest to the most frequent symbol.
    """
    present = [s for s, c in enumerate(counts) if c]
    lengths = [0] * len(counts)
    if len(present) <= 1:
        for s in present:
            lengths[s] = 1
        return lengths
    heap = [(counts[s], s, [s]) for s in present]
    heapq.heapify(heap)
    depth = dict.fromkeys(present, 0)
    while len(heap) > 1:
        c1, t1, s1 = heapq.heappop(heap)
        c2, t2, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            depth[s] += 1
        heapq.heappush(heap, (c1 + c2, min(t1, t2), s1 + s2))
    longest = max(depth.values())
    per_len = [0] * (longest + 1)
    for d in depth.values():
        per_len[d] += 1
    for i in range(longest, max_len, -1):
        while per_len[i] > 0:
            j = i - 2
            while per_len[j] == 0:
                j -= 1
            per_len[i] -= 2
            per_len[i - 1] += 1
            per_len[j + 1] += 2
            per_len[j] -= 1
    ranked = sorted(present, key=lambda s: (-counts[s], s))
    at = 0
    for length, k in enumerate(per_len[:max_len + 1]):
        for s in ranked[at:at + k]:
            lengths[s] = length
        at += k
    return lengths


def _canonical(lengths: list[int]) -> tuple[list[int], torch.Tensor]:
    """Canonical codes for ``lengths`` and the decoder's lookup table, indexed by the peek
    (:func:`~shuttle.kernels.exponent_decode.stored_table` gives the order it is stored in).
    """
    codes = [0] * len(lengths)
    lut = torch.zeros(1 << MAX_LEN, dtype=torch.int16)
    code, prev = 0, 0
    for s in sorted((s for s, n in enumerate(lengths) if n), key=lambda s: (lengths[s], s)):
        code <<= lengths[s] - prev
        prev = lengths[s]
        codes[s] = code
        span = MAX_LEN - lengths[s]
        lut[code << span:(code + 1) << span] = s << 4 | lengths[s]
        code += 1
    return codes, lut


def _values(patterns: torch.Tensor, lo: int) -> torch.Tensor:
    """The slice of int16 ``patterns`` at ``lo`` as 16-bit values, int32 in 0..65535."""
    return patterns[lo:lo + _SLICE].to(torch.int32) & 0xFFFF


def _elsewhere(at: torch.device, device: torch.device | str) -> bool:
    """Whether a tensor on ``at`` is not on ``device``; a device without an index ("cuda")
    takes a tensor on any device of its type (``torch.device("cuda") != torch.device("cuda",
    0)``: compared as is, a tensor moved to "cuda" would never be found there).
    """
    device = torch.device(device)
    if device.type != at.type:
        return True
    return device.index is not None and device.index != at.index


def _code_of(patterns: torch.Tensor, bf16: bool) -> tuple[list[int], list[int]]:
    """The symbols' counts in int16 ``patterns`` (one pass, slice by slice) and their code
    lengths.
    """
    counts = torch.zeros(256, dtype=torch.int64, device=patterns.device)
    for lo in range(0, patterns.numel(), _SLICE):
        counts += torch.bincount(_split(_values(patterns, lo), bf16)[0], minlength=256)
    counts_list = counts.tolist()
    return counts_list, code_lengths(counts_list)


def _split(v: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, raw byte) of 16-bit patterns ``v`` (int32 in 0..65535)."""
    if bf16:
        return (v >> 7) & 0xFF, ((v >> 8) & 0x80) | (v & 0x7F)
    return v >> 8, v & 0xFF


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError, TypeError):  # another C library, or Windows
        return None


def _release_freed_host_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). After a large free, glibc serves the next tens-of-MB temporaries from its heap and
    keeps their pages: without this the CPU encoder's resident memory grew by its temporaries
    on every slice (3.6 GB for a 512 MB tensor, 0.8 GB with it).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64, as int32 bit patterns."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _encode_chunk(sym: torch.Tensor, table: torch.Tensor, first_word: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The words and the lanes' first words (relative to the tensor) of the symbols ``sym``
    (int32) of a run of whole groups (the last one possibly short); ``table[s]`` is symbol
    ``s``'s ``code << 4 | length``.
    """
    groups = -(-sym.numel() // GROUP)
    # index_select: advanced indexing (table[sym]) is far slower on the CPU
    entry = torch.nn.functional.pad(table.index_select(0, sym), (0, groups * GROUP - sym.numel()))
    entry = entry.view(groups, STEPS, LANES)
    size = entry & 15
    lane_words = (size.sum(1, dtype=torch.int32) + 31) // 32  # (groups, LANES)
    flat_words = lane_words.reshape(-1)
    starts = torch.cumsum(flat_words, 0, dtype=torch.int64) - flat_words
    total = int(starts[-1]) + int(flat_words[-1])
    # a code's first bit, relative to the chunk (< 2**31: a chunk is at most 64 groups)
    bit = (starts.to(torch.int32).view(groups, 1, LANES) * 32
           + torch.cumsum(size, 1, dtype=torch.int32) - size).reshape(-1)
    # Each code is added into the 64-bit window of the word it starts in (that word the high
    # half, the next the low half): bits [64 - shift - size, 64 - shift). Codes never overlap,
    # so adding is or-ing (mod 2**64: a code at bit 63 makes the sum negative, same bits); a
    # word is then its window's high half plus the low half of the window before it.
    word = (bit >> 5).to(torch.int64)
    up = (64 - (bit & 31) - size.reshape(-1)).to(torch.int64)  # padding: size 0, code 0
    windows = torch.zeros(total + 2, dtype=torch.int64, device=sym.device)  # (size-0 codes may
    # point one past the end)
    windows.index_add_(0, word, (entry.reshape(-1) >> 4).to(torch.int64) << up)
    words = (windows[:total] >> 32) & 0xFFFFFFFF
    words[1:] += windows[:total - 1] & 0xFFFFFFFF
    return words, starts + first_word


@register_representation("lossless")
@dataclasses.dataclass
class LosslessTensor(WeightRepresentation):
    """A bfloat16/float16 tensor, lossless coded in one ``uint8`` blob.

    Attributes:
        blob: the coded parts (module docstring), ``uint8``, on any device.
        shape: the tensor's shape.
        dtype: bfloat16 or float16.
        words: code words in the blob (without the padding word).
    """

    tensor_names = ("blob",)
    shape_field = "shape"
    compute_field = "dtype"

    blob: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    words: int

    @classmethod
    def encode_tensor(cls, tensor: torch.Tensor, *, always: bool = False
                      ) -> LosslessTensor | None:
        """``tensor`` (bfloat16 or float16, any shape) coded on its device (the blob stays
        there), or None where the code would not be smaller than its raw bytes (``always``:
        coded anyway, unless it is empty). The code is the same on every device.

        Raises:
            ShuttleError: ``tensor`` is neither bfloat16 nor float16.
        """
        if tensor.dtype not in CODED_DTYPES:
            raise ShuttleError(f"lossless coding takes bfloat16 or float16 tensors, not "
                               f"{tensor.dtype}; keep it as it is")
        bf16 = tensor.dtype == torch.bfloat16
        patterns = tensor.detach().reshape(-1).view(torch.int16)
        n, device = patterns.numel(), patterns.device
        if n == 0:
            return None

        # Two passes over the tensor, slice by slice: the symbols' counts (the code), then the
        # code itself; slices are whole chunks, so the bytes are those of a single pass.
        counts, lengths = _code_of(patterns, bf16)
        bits = sum(c * size for c, size in zip(counts, lengths, strict=True))
        if not always and blob_nbytes(n, -(-bits // 32)) >= n * 2:  # padding only adds
            return None
        codes, lut = _canonical(lengths)
        table = torch.tensor([c << 4 | size for c, size in zip(codes, lengths, strict=True)],
                             dtype=torch.int32, device=device)
        raw = torch.empty(n, dtype=torch.uint8, device=device)
        pieces, starts, checks, at = [], [], [], 0
        step = _CHUNK_GROUPS * GROUP
        for lo in range(0, n, _SLICE):
            flat = _values(patterns, lo)
            sym, low = _split(flat, bf16)
            raw[lo:lo + flat.numel()].copy_(low)
            checks.append(group_checks(flat))
            for c in range(0, flat.numel(), step):
                words, first = _encode_chunk(sym[c:c + step], table, at)
                pieces.append(_to_int32(words))  # int32 as they will lie in the blob
                starts.append(first)
                at += words.numel()
            if device.type == "cpu":
                del flat, sym, low
                _release_freed_host_memory()
        if not always and blob_nbytes(n, at) >= n * 2:
            return None
        offsets = torch.cat([*starts, torch.tensor([at], device=device)])
        # zeros: the alignment gaps between parts are part of the blob (and of a file's bytes)
        rep = cls(torch.zeros(blob_nbytes(n, at), dtype=torch.uint8, device=device),
                  tensor.shape, tensor.dtype, at)
        p = rep.parts()
        p.lut.copy_(stored_table(lut))
        p.checks.copy_(torch.cat(checks))
        p.offsets.copy_(offsets.to(torch.int32))
        p.raw.copy_(raw)
        p.words[:at].copy_(torch.cat(pieces))
        return rep

    @staticmethod
    def code_size(tensor: torch.Tensor, *, always: bool = False,
                  device: torch.device | str | None = None) -> tuple[int, int] | None:
        """``(words, blob bytes)`` of the code :meth:`encode_tensor` would make of ``tensor``
        (None where it would make none), found without making it: the symbols' counts give
        the code lengths, and each lane's words are its codes' bits rounded up to 32. About a
        third of coding's time (a file's header, written before its tensors, needs the sizes).
        Computed on ``device`` as :meth:`encode_host` codes (default: the GPU when there is
        one; the CPU where it has not the memory).
        """
        if tensor.dtype not in CODED_DTYPES:
            raise ShuttleError(f"lossless coding takes bfloat16 or float16 tensors, not "
                               f"{tensor.dtype}; keep it as it is")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else tensor.device
        if _elsewhere(tensor.device, device):
            try:
                return LosslessTensor.code_size(tensor.to(device, non_blocking=True),
                                                always=always, device=device)
            except torch.OutOfMemoryError:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                return LosslessTensor.code_size(tensor, always=always, device=tensor.device)
        patterns = tensor.detach().reshape(-1).view(torch.int16)
        n = patterns.numel()
        if n == 0:
            return None
        bf16 = tensor.dtype == torch.bfloat16
        _, lengths = _code_of(patterns, bf16)
        size_of = torch.tensor(lengths, dtype=torch.int32, device=patterns.device)
        words = 0
        for lo in range(0, n, _SLICE):  # whole groups: a lane's words lie in one slice
            size = size_of.index_select(0, _split(_values(patterns, lo), bf16)[0])
            groups = -(-size.numel() // GROUP)
            size = torch.nn.functional.pad(size, (0, groups * GROUP - size.numel()))
            words += int(((size.view(groups, STEPS, LANES).sum(1, dtype=torch.int32) + 31)
                          // 32).sum())
        if not always and blob_nbytes(n, words) >= n * 2:
            return None
        return words, blob_nbytes(n, words)

    @classmethod
    def encode_host(cls, tensor: torch.Tensor, device: torch.device | str | None = None
                    ) -> LosslessTensor | None:
        """:meth:`encode_tensor` on ``device`` (default: the GPU when there is one: the code is
        the same, in a fraction of the CPU's time), its blob returned in host memory.

        Coding takes a few times the tensor's bytes (its raw bytes, the code, one slice's
        temporaries); where ``device`` has not the memory (a small card), the tensor is coded
        on the CPU instead.
        """
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type != "cpu":
            try:
                rep = cls.encode_tensor(tensor.to(device, non_blocking=True))
                return None if rep is None else dataclasses.replace(rep, blob=rep.blob.cpu())
            except torch.OutOfMemoryError:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # the failed attempt's blocks, for the model
        return cls.encode_tensor(tensor.cpu())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ratio(self) -> float:
        """Coded bytes over raw bytes."""
        return self.blob.numel() / (2 * self.numel) if self.numel else 1.0

    def parts(self, blob: torch.Tensor | None = None) -> Parts:
        """Views of the parts of ``blob`` (default: this one's), which has this layout.

        Raises:
            CorruptCodeError: ``blob`` has not the size its layout needs.
        """
        blob = self.blob if blob is None else blob
        spans = _part_spans(self.numel, self.words)
        if blob.dtype != torch.uint8 or blob.numel() != spans[-1][0]:
            raise CorruptCodeError(
                f"a lossless-coded tensor of shape {tuple(self.shape)} needs a uint8 blob of "
                f"{spans[-1][0]} bytes, got {blob.numel()} bytes of {blob.dtype}: the file or "
                "buffer was truncated or written by something else; write it again with "
                "`shuttle compress`")
        return Parts(*(blob[at:at + count * dt.itemsize].view(dt)
                       for at, count, dt in spans[:-1]))

    def decode_into(self, out: torch.Tensor, errors: torch.Tensor,
                    blob: torch.Tensor | None = None) -> None:
        """Queue the decode of ``blob`` (default: this one's, on ``out``'s device) into ``out``
        (contiguous, this dtype and numel) on the current stream; every group found wrong adds
        one to ``errors`` (int32, one element, same device). Nothing is read back: check
        ``errors`` before trusting ``out`` (:meth:`decode` does).
        """
        p = self.parts(blob)
        decode_exponents(p.words, p.offsets, p.lut, p.raw, p.checks,
                         out.view(-1).view(torch.int16), errors, self.dtype == torch.bfloat16)

    def decode(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The original tensor, bit for bit, on ``device`` (default: the blob's).

        Raises:
            CorruptCodeError: the code stream is damaged (a check failed); nothing is returned.
        """
        device = self.blob.device if device is None else torch.device(device)
        blob = self.blob.to(device, non_blocking=True)
        out = torch.empty(self.shape, dtype=self.dtype, device=device)
        errors = torch.zeros(1, dtype=torch.int32, device=device)
        self.decode_into(out, errors, blob)
        if int(errors.item()):
            raise CorruptCodeError(
                f"a lossless-coded tensor of shape {tuple(self.shape)} failed its checks in "
                f"{int(errors.item())} of {-(-self.numel // GROUP)} groups: its bytes were "
                "damaged; read it from a good copy or write it again with `shuttle compress`")
        return out

    def dequantize(self) -> torch.Tensor:
        return self.decode().float()

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> LosslessTensor:
        """``x`` rounded to this dtype and coded again (on ``x``'s device; the blob then
        moves to this representation's device). Coded even where that no longer saves bytes,
        so that the form is kept.
        """
        rounded = round_float(x, self.dtype, rounding, generator)
        rep = LosslessTensor.encode_tensor(rounded, always=True)
        assert rep is not None  # only an empty tensor has no code
        return dataclasses.replace(rep, blob=rep.blob.to(self.blob.device))
