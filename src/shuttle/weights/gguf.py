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

:class:`GGUFParameter` puts such a weight into a module: a parameter that stores the blocks and
dequantizes them whenever an operation uses it (``nn.Linear`` then computes
``F.linear(x, dequantized)``); :class:`GGUFWeight` is its representation (shared bytes), so
dynamic adapters and the offloader handle it like any other quantized weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from shuttle.errors import ShuttleError
from shuttle.weights.representation import WeightRepresentation, register_representation

__all__ = ["GGUF_TYPES", "GGUFParameter", "GGUFWeight", "dequantize_blocks"]


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
    high = (qh >> (2 * torch.arange(4, device=b.device).reshape(1, 1, 4, 1))) & 3
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
    param_attrs = {"raw": "data"}  # the GGUFParameter's bytes; its class and metadata stay
    shape_field = "shape"
    mergeable = False

    def __post_init__(self) -> None:
        self.qtype = _qtype_name(self.qtype)
        self.shape = tuple(int(s) for s in self.shape)
        values, size, *_ = GGUF_TYPES[self.qtype]
        numel = torch.Size(self.shape).numel()
        # raw is None only in a layout record (the offloader keeps the form, drops tensors)
        if self.raw is not None and self.raw.numel() * values != numel * size:
            raise ShuttleError(f"GGUF {self.qtype} data of {self.raw.numel()} bytes does not hold "
                               f"a weight of shape {self.shape} ({numel} values)")

    def dequantize(self) -> torch.Tensor:
        return dequantize_blocks(self.raw, self.qtype).reshape(self.shape)

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, GGUFParameter)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> GGUFWeight:
        """Wrap a :class:`GGUFParameter`; its bytes are shared, not copied."""
        return cls(_bytes(tensor), tensor.qtype, tensor.weight_shape, tensor.compute_dtype)

    def to_parameter(self) -> GGUFParameter:
        """A new :class:`GGUFParameter` over this weight's bytes (no copy)."""
        return GGUFParameter(self.raw, self.qtype, self.shape, self.compute)

def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor over ``t``'s stored bytes (shared, not copied)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach()


def _rebuild_gguf(raw: torch.Tensor, qtype: str, weight_shape: tuple[int, ...],
                  compute_dtype: torch.dtype) -> GGUFParameter:
    return GGUFParameter(raw, qtype, weight_shape, compute_dtype)


# Tensor methods that read or describe the stored bytes themselves: run on the uint8 tensor.
_STORED = frozenset({
    "__hash__", "__dir__", "__format__", "__len__", "__setstate__", "__dlpack__",
    "__dlpack_device__", "data_ptr", "untyped_storage", "storage", "_typed_storage",
    "storage_offset", "element_size", "size", "dim", "ndimension", "numel", "nelement",
    "stride", "is_contiguous", "is_pinned", "is_shared", "share_memory_", "is_floating_point",
    "is_complex", "is_signed", "get_device", "requires_grad_", "record_stream", "_is_view",
    "is_inference",
})
# ... and those that return the stored bytes again, elsewhere or copied: still a GGUFParameter.
_KEEP = frozenset({"cuda", "cpu", "detach", "clone", "pin_memory", "contiguous"})
# Getters that are operations on the values, not metadata: they dequantize.
_VALUE_GETTERS = frozenset({"T", "mT", "H", "mH", "real", "imag"})


class GGUFParameter(torch.nn.Parameter):
    """A parameter that stores GGUF blocks and dequantizes them on use.

    The tensor itself *is* the stored bytes: uint8, ``(rows, row_bytes)`` as the file holds
    them (any shape of whole blocks); ``qtype``, ``weight_shape`` (the logical, torch-order
    shape) and ``compute_dtype`` ride along as attributes.

    What stays stored: moves and copies (``.to(device)``, ``.cuda()``, ``.cpu()``,
    ``.pin_memory()``, ``.detach()``, ``.clone()``, ``.data``, ``copy.deepcopy``, pickling)
    keep the bytes, the class and the metadata; ``.to(float_dtype)`` only changes
    ``compute_dtype``. Metadata queries (``shape``, ``dtype``, ``device``, ``numel()``,
    ``data_ptr()``, ``is_floating_point()``) describe the bytes, so ``model.half()`` leaves the
    weight as it is. ``copy_`` copies bytes (from uint8 data or another GGUFParameter) and
    ``param.data = raw`` rebinds them; every other in-place operation is refused.

    What dequantizes: every other operation that takes it (``F.linear``, ``matmul``, ``@``,
    ``.T``, ``.float()``, ``torch.cat`` ...) first gets the weight dequantized to
    ``compute_dtype`` on the bytes' device, ``weight_shape``; that tensor lives for the one call
    only (nothing is cached, so memory holds the blocks plus one transient weight at a time).
    An ``nn.Linear`` whose ``weight`` is one computes ``F.linear(x, dequantized, bias)``.

    Not mergeable (:class:`GGUFWeight`); adapters run over it in dynamic mode. No gradient
    (uint8 bytes); ``torch.compile`` over it is not covered.

    Args:
        raw: uint8 whole blocks (a GGUFParameter gives its bytes); shared, not copied.
        qtype: a name (``"Q4_K"``) or a ggml type id.
        weight_shape: the logical shape, holding exactly the blocks' values.
        compute_dtype: the dtype the dequantized weight has (default bfloat16).

    Raises:
        ShuttleError: an unsupported type, non-uint8 data, or bytes that do not hold
            ``weight_shape``.
    """

    qtype: str
    weight_shape: tuple[int, ...]
    compute_dtype: torch.dtype

    def __new__(cls, raw: torch.Tensor, qtype: str | int, weight_shape: tuple[int, ...],
                compute_dtype: torch.dtype = torch.bfloat16) -> GGUFParameter:
        raw = _bytes(raw)
        if raw.dtype != torch.uint8:
            raise ShuttleError(f"GGUFParameter stores uint8 block bytes, got {raw.dtype}")
        w = GGUFWeight(raw, qtype, tuple(weight_shape), compute_dtype)  # validates
        self = torch.Tensor._make_subclass(cls, raw, False)
        self.qtype, self.weight_shape, self.compute_dtype = w.qtype, w.shape, compute_dtype
        return self

    @classmethod
    def from_weight(cls, weight: GGUFWeight) -> GGUFParameter:
        """The parameter over a :class:`GGUFWeight`'s bytes (no copy)."""
        return cls(weight.raw, weight.qtype, weight.shape, weight.compute)

    def _like(self, raw: torch.Tensor, compute_dtype: torch.dtype | None = None
              ) -> GGUFParameter:
        return GGUFParameter(raw, self.qtype, self.weight_shape,
                             compute_dtype or self.compute_dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight: ``weight_shape``, ``compute_dtype``, on the bytes' device (a new tensor)."""
        out = dequantize_blocks(_bytes(self), self.qtype).reshape(self.weight_shape)
        return out.to(self.compute_dtype)

    def __repr__(self, *, tensor_contents: object = None) -> str:
        raw = _bytes(self)
        return (f"GGUFParameter({self.qtype}, weight_shape={self.weight_shape}, "
                f"compute_dtype={self.compute_dtype}, {raw.numel()} bytes, device={raw.device})")

    def __reduce_ex__(self, proto: int) -> tuple:
        return _rebuild_gguf, (_bytes(self), self.qtype, self.weight_shape, self.compute_dtype)

    def __deepcopy__(self, memo: dict) -> GGUFParameter:
        if id(self) not in memo:
            memo[id(self)] = self._like(_bytes(self).clone())
        return memo[id(self)]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__delete__"):
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if name != "__get__" or prop not in _VALUE_GETTERS:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                return args[0]._like(out) if name == "__get__" and prop == "data" else out
        elif name in _STORED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        elif name in _KEEP or name == "to":
            self, compute = args[0], None
            with torch._C.DisableTorchFunctionSubclass():
                if name != "to":
                    out = func(*args, **kwargs)
                else:  # the bytes move; a float dtype becomes the compute dtype
                    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                    if dtype is not None and dtype.is_floating_point:
                        compute = dtype
                    out = self if device is None else func(self, device, non_blocking=non_blocking)
            if out is self and compute in (None, self.compute_dtype):
                return self
            return self._like(out, compute)
        elif name == "copy_":
            dst, src = args[0], args[1]
            if isinstance(src, GGUFParameter) and (src.qtype, src.weight_shape) != (
                    dst.qtype, dst.weight_shape):
                raise ShuttleError(f"cannot copy a GGUF {src.qtype} {src.weight_shape} weight "
                                   f"into a {dst.qtype} {dst.weight_shape} one")
            if src.dtype != torch.uint8:
                raise ShuttleError(
                    f"copy_ into a GGUFParameter takes its uint8 block bytes, not {src.dtype} "
                    "values: GGUF blocks cannot be re-encoded here")
            with torch._C.DisableTorchFunctionSubclass():
                _bytes(dst).copy_(_bytes(src), *args[2:], **kwargs)
            return dst
        elif name.endswith("_") and not name.startswith("__"):
            raise ShuttleError(
                f"{name} would change a GGUFParameter's dequantized copy, not its blocks; "
                "dequantize it into a plain parameter first (GGUF blocks are not re-encoded)")

        def dq(a: object) -> object:
            return a.dequantize() if isinstance(a, GGUFParameter) else a

        args, kwargs = pytree.tree_map(dq, (args, kwargs))
        return func(*args, **kwargs)
