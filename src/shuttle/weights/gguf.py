"""GGUF block-quantized weights, dequantized in pure torch from the raw block bytes.

Block layouts (ggml ``ggml-common.h``; all little-endian, ``d``/``dmin`` are float16):

- ``Q8_0``: 32 values in 34 bytes: ``d``, then 32 int8 ``q``;  ``x = d * q``.
- ``Q4_0``: 32 values in 18 bytes: ``d``, then 16 bytes of nibbles; value ``j < 16`` is the low
  nibble of byte ``j``, value ``j + 16`` its high nibble;  ``x = d * (q - 8)``.
- ``Q4_K``: 256 values in 144 bytes: ``d``, ``dmin``, 12 bytes holding 8 six-bit scales and 8
  six-bit mins, 128 bytes of nibbles. Sub-block ``i`` (32 values) is
  ``x = d * sc[i] * q - dmin * m[i]``; each 32-byte group of nibbles holds sub-block ``2k`` in
  its low nibbles and ``2k + 1`` in its high nibbles.
- ``Q6_K``: 256 values in 210 bytes: ``ql`` (128 bytes, low 4 bits), ``qh`` (64 bytes, high 2
  bits), 16 int8 scales, ``d``;  ``x = d * sc[j // 16] * (q - 32)`` with ``q`` six bits.

A GGUF encoding is fixed offline (its scales come from an importance-weighted search), so these
weights are not mergeable: adapters over them run in dynamic mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from shuttle.errors import ShuttleError
from shuttle.weights.representation import WeightRepresentation, register_representation

__all__ = ["GGUF_TYPES", "GGUFWeight", "dequantize_blocks"]


def _f16(b: torch.Tensor) -> torch.Tensor:
    # (n, 2) uint8, little-endian -> (n, 1) float32
    return b.contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # b: (n, 34) -> (n, 32)
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # b: (n, 18) -> (n, 32): low nibbles are values 0..15, high nibbles 16..31
    qs = b[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float() - 8
    return _f16(b[:, :2]) * q


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # s: (n, 12) packed 6-bit scales and mins -> two (n, 8) tensors.
    # j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: the low 4 bits come from s[j+4]'s nibbles
    # and the high 2 bits from the top bits of s[j-4] (scale) and s[j] (min).
    s = s.to(torch.int32)
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).float(), torch.cat([lo_m, hi_m], 1).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # b: (n, 144) -> (n, 256)
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()  # sub-block order
    return (d.unsqueeze(2) * sc.unsqueeze(2) * q - (dmin * m).unsqueeze(2)).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # b: (n, 210) -> (n, 256), two halves of 128 values, each from 64 ql and 32 qh bytes:
    # value l + 32*k of a half (l < 32, k < 4) takes nibble (k >= 2) of ql[l + 32*(k % 2)] and
    # bits 2k..2k+1 of qh[l].
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32).to(torch.int32)  # (half, k % 2, l)
    qh = b[:, 128:192].reshape(n, 2, 1, 32).to(torch.int32)  # (half, 1, l)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16): one per 16 values
    d = _f16(b[:, 208:210])
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # (n, 2, 4, 32), k order 0..3
    high = (qh >> (2 * torch.arange(4).reshape(1, 1, 4, 1))) & 3
    q = ((low | (high << 4)) - 32).float().reshape(n, 256)
    return d * sc.repeat_interleave(16, dim=1) * q


# name -> (values per block, bytes per block, ggml type id, dequantize (n, bytes) -> (n, values))
GGUF_TYPES: dict[str, tuple[int, int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q4_0": (32, 18, 2, _q4_0),
    "Q8_0": (32, 34, 8, _q8_0),
    "Q4_K": (256, 144, 12, _q4_k),
    "Q6_K": (256, 210, 14, _q6_k),
}


def _qtype_name(qtype: str | int) -> str:
    if isinstance(qtype, str) and qtype.upper() in GGUF_TYPES:
        return qtype.upper()
    for name, (*_, type_id, _fn) in GGUF_TYPES.items():
        if not isinstance(qtype, str) and int(qtype) == type_id:
            return name
    raise ShuttleError(f"GGUF quantization type {qtype!r} is not supported; supported: "
                       f"{', '.join(GGUF_TYPES)}")


def dequantize_blocks(raw: torch.Tensor, qtype: str | int) -> torch.Tensor:
    """Dequantize GGUF blocks.

    Args:
        raw: uint8 tensor of whole blocks, any shape (a GGUF file stores ``(rows, row_bytes)``).
        qtype: a name (``"Q8_0"``) or a ggml type id (``gguf.GGMLQuantizationType.Q8_0``).

    Returns:
        float32 values, flat, in storage order (``numel = blocks * values_per_block``).

    Raises:
        ShuttleError: an unsupported type, a non-uint8 tensor, or bytes not whole blocks.
    """
    name = _qtype_name(qtype)
    values, size, _, fn = GGUF_TYPES[name]
    if raw.dtype != torch.uint8 or raw.numel() % size:
        raise ShuttleError(f"GGUF {name} data must be uint8 of whole {size}-byte blocks; got "
                           f"{raw.dtype} with {raw.numel()} elements")
    return fn(raw.reshape(-1, size)).reshape(-1)


@register_representation("gguf")
@dataclasses.dataclass
class GGUFWeight(WeightRepresentation):
    """GGUF blocks kept as stored; dequantized on use. Not mergeable.

    Attributes:
        raw: uint8 block bytes.
        qtype: quantization type name or ggml type id (normalized to the name).
        shape: the weight's logical shape (torch order: rows first).
        compute: the dtype layers compute in (default bfloat16).

    Raises:
        ShuttleError: an unsupported type, or ``raw`` does not hold ``prod(shape)`` values.
    """

    raw: torch.Tensor
    qtype: str | int
    shape: tuple[int, ...]
    compute: torch.dtype = torch.bfloat16

    tensor_names = ("raw",)
    mergeable = False

    def __post_init__(self) -> None:
        self.qtype = _qtype_name(self.qtype)
        self.shape = tuple(int(s) for s in self.shape)
        values, size, *_ = GGUF_TYPES[self.qtype]
        numel = torch.Size(self.shape).numel()
        if self.raw.numel() * values != numel * size:
            raise ShuttleError(f"GGUF {self.qtype} data of {self.raw.numel()} bytes does not hold "
                               f"a weight of shape {self.shape} ({numel} values)")

    @property
    def logical_shape(self) -> torch.Size:
        return torch.Size(self.shape)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.compute

    def dequantize(self) -> torch.Tensor:
        return dequantize_blocks(self.raw, self.qtype).reshape(self.shape)
