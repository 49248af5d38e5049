"""bitsandbytes weights: 4-bit NF4/FP4 (``Params4bit`` + ``QuantState``) and int8 (``Int8Params``).

4-bit layout (``bitsandbytes.functional.quantize_4bit``): the weight is flattened and cut into
blocks of ``blocksize`` values; block ``b`` keeps ``absmax[b] = max |x|`` and each value the
4-bit index of the nearest entry of a 16-value code in ``[-1, 1]`` (NF4: normal quantiles, FP4:
a tiny float format)::

    x[b, j] = code[idx[b, j]] * absmax[b]

Two indices share a byte, the first in the high nibble. With double quantization ("nested",
``compress_statistics=True``) ``absmax`` itself is stored as uint8 indices into an 8-bit dynamic
code, in blocks of 256, after subtracting its mean::

    absmax[b] = code2[q[b]] * absmax2[b // 256] + offset

int8 (``Int8Params``, LLM.int8() weights): one float32 ``SCB`` per row (the row's absmax) and
``x = CB * SCB / 127``.

All math here is pure torch (so it runs on any device); bitsandbytes is imported only to build
or recognise its own classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from shuttle.errors import UnsupportedLayerError
from shuttle.kernels.rounding import Rounding
from shuttle.optional import import_optional
from shuttle.weights.representation import WeightRepresentation, register_representation

__all__ = ["Bnb4bitWeight", "BnbInt8Weight"]

_INSTALL = "pip install shuttle[bnb]"


def _bnb() -> Any:
    """The ``bitsandbytes`` module, or an error naming the extra to install."""
    return import_optional("bitsandbytes", "bitsandbytes weights", _INSTALL)


def _is_bnb(tensor: object) -> bool:
    # Checked before importing bitsandbytes: only its own tensors can be its parameters.
    return type(tensor).__module__.split(".")[0] == "bitsandbytes"


def _pick(lo: torch.Tensor, hi: torch.Tensor, v: torch.Tensor, v_lo: torch.Tensor,
          v_hi: torch.Tensor, rounding: Rounding, generator: torch.Generator | None
          ) -> torch.Tensor:
    """Choose ``lo`` or ``hi`` for ``v`` in ``[v_lo, v_hi]``: the nearer one (ties go to ``lo``),
    or stochastically with ``P(hi) = (v - v_lo) / (v_hi - v_lo)`` so that the expected value is
    ``v`` (one ``torch.rand`` draw of ``v.shape`` from ``generator``).
    """
    gap = v_hi - v_lo
    if rounding == "nearest":
        return torch.where(v - v_lo > v_hi - v, hi, lo)
    p = torch.where(gap > 0, (v - v_lo) / torch.where(gap > 0, gap, torch.ones_like(gap)),
                    torch.zeros_like(v))
    u = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
    return torch.where(u < p, hi, lo)


def _to_code(v: torch.Tensor, code: torch.Tensor, rounding: Rounding,
             generator: torch.Generator | None) -> torch.Tensor:
    """Indices into ``code`` (any order) for values ``v`` already inside ``[min, max]`` of it."""
    sorted_code, perm = code.float().sort()
    hi = torch.searchsorted(sorted_code, v.contiguous()).clamp(1, code.numel() - 1)
    lo = hi - 1
    pos = _pick(lo, hi, v, sorted_code[lo], sorted_code[hi], rounding, generator)
    return perm[pos]


# The code tensor -> its order for the merge kernel: a model's 4-bit weights share one code (one
# per device), so its order is computed once per code, not per weight. Weakly keyed by the code
# tensor (an entry dies with it) and checked against its version counter: a derivation of the
# code's values that cannot change a result, only skip the sort.
_ORDERS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _code_order(code: torch.Tensor) -> Any:
    from shuttle.kernels.merge_nf4 import code_order

    hit = _ORDERS.get(code)
    if hit is None or hit[0] != code._version:
        hit = _ORDERS[code] = (code._version, code_order(code))
    return hit[1]


def _blocks(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``x`` flattened, zero-padded to whole blocks: ``(blocks, blocksize)`` float32."""
    flat = x.reshape(-1).float()
    pad = -flat.numel() % blocksize
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, blocksize)


@register_representation("bnb_4bit")
@dataclasses.dataclass
class Bnb4bitWeight(WeightRepresentation):
    """A bitsandbytes NF4/FP4 weight: packed indices plus its ``QuantState``'s tensors.

    Attributes:
        packed: two 4-bit indices per byte (high nibble first), ``Params4bit.data`` as stored
            (uint8, or the ``quant_storage`` dtype viewing the same bytes).
        absmax: per-block scale: float32, or uint8 indices into ``nested_code`` when nested.
        code: the 16-value code (NF4 or FP4), float32.
        offset: nested only: the mean subtracted from the absmax before its quantization.
        nested_absmax, nested_code: nested only: float32 scale per 256 absmax values, and the
            256-value dynamic code.
        shape: the weight's logical shape.
        blocksize, nested_blocksize: values per block (``nested_blocksize`` None unless nested).
        quant_type: ``"nf4"`` or ``"fp4"``.
        dtype: the compute dtype (``QuantState.dtype``).
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    offset: torch.Tensor | None
    nested_absmax: torch.Tensor | None
    nested_code: torch.Tensor | None
    shape: tuple[int, ...]
    blocksize: int
    nested_blocksize: int | None
    quant_type: str
    dtype: torch.dtype

    tensor_names = ("packed", "absmax", "code", "offset", "nested_absmax", "nested_code")
    param_attrs = {"packed": "data", "absmax": "quant_state.absmax",
                   "code": "quant_state.code", "offset": "quant_state.offset",
                   "nested_absmax": "quant_state.state2.absmax",
                   "nested_code": "quant_state.state2.code"}
    shape_field, compute_field = "shape", "dtype"

    @property
    def nested(self) -> bool:
        """Whether the per-block absmax is itself quantized (double quantization)."""
        return self.nested_absmax is not None

    def _scales(self, absmax: torch.Tensor | None = None, nested_absmax: torch.Tensor | None = None,
                offset: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 per-block absmax (dequantizing the nested level where there is one)."""
        absmax = self.absmax if absmax is None else absmax
        if not self.nested:
            return absmax.float()
        nested_absmax = self.nested_absmax if nested_absmax is None else nested_absmax
        offset = self.offset if offset is None else offset
        q = _blocks(self.nested_code.float()[absmax.long()], self.nested_blocksize)
        return (q * nested_absmax.float().view(-1, 1)).reshape(-1)[:absmax.numel()] + offset

    def dequantize(self) -> torch.Tensor:
        b = self.packed.contiguous().view(torch.uint8).reshape(-1)
        idx = torch.stack([b >> 4, b & 0x0F], dim=1).reshape(-1).long()
        values = self.code.float()[idx]
        numel = self.logical_shape.numel()
        blocks = _blocks(values[:numel], self.blocksize)
        return (blocks * self._scales().view(-1, 1)).reshape(-1)[:numel].reshape(self.shape)

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> Bnb4bitWeight:
        blocks = _blocks(x, self.blocksize)  # (n_blocks, blocksize)
        amax = blocks.abs().amax(dim=1)
        absmax, offset, nested_absmax = amax, None, None
        if self.nested:
            # The absmax is quantized with rounding *up* in the dynamic code, so that no value
            # of a block lands outside [-absmax, absmax] and needs clamping: the 4-bit rounding
            # below stays unbiased, at the cost of a step at most one code gap wider.
            offset = amax.mean()
            centred = _blocks(amax - offset, self.nested_blocksize)
            nested_absmax = centred.abs().amax(dim=1)
            nested_absmax = torch.where(nested_absmax > 0, nested_absmax,
                                        torch.ones_like(nested_absmax))
            v = (centred / nested_absmax.view(-1, 1)).reshape(-1)[:amax.numel()]
            sorted_code, perm = self.nested_code.float().sort()
            up = torch.searchsorted(sorted_code, v.contiguous()).clamp(max=sorted_code.numel() - 1)
            absmax = perm[up].to(torch.uint8)
            offset = offset.reshape(self.offset.shape).to(self.offset.dtype)
            nested_absmax = nested_absmax.to(self.nested_absmax.dtype)
        scales = self._scales(absmax, nested_absmax, offset)
        # A zero block (or a scale that rounded to zero) encodes as code 0: divide by 1 there.
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        v = (blocks / safe.view(-1, 1)).clamp(-1, 1).reshape(-1)[:self.logical_shape.numel()]
        idx = _to_code(v, self.code, rounding, generator).to(torch.uint8)
        nbytes = self.packed.numel() * self.packed.element_size()
        idx = torch.cat([idx, idx.new_zeros(2 * nbytes - idx.numel())]).view(-1, 2)
        packed = ((idx[:, 0] << 4) | idx[:, 1]).view(self.packed.dtype).view(self.packed.shape)
        if not self.nested:
            absmax = absmax.to(self.absmax.dtype)
        return dataclasses.replace(self, packed=packed, absmax=absmax, offset=offset,
                                   nested_absmax=nested_absmax)

    def merge_lowrank(self, up: torch.Tensor, down: torch.Tensor, seg: list[int],
                      scales: list[float], *, rounding: Rounding = "nearest",
                      seed: int = 0) -> Bnb4bitWeight | None:
        """``encode(dequantize() + sum_i scales[i] * up[:, seg_i] @ down[seg_i])`` by one Triton
        kernel (:func:`shuttle.kernels.merge_nf4.merge_4bit`), without a dense float32 weight.

        Nearest rounding equals ``encode`` except where float32 summation order moves a value
        across a code midpoint; stochastic rounding uses the kernel's own random stream
        (``seed`` and the element index), not a ``torch.Generator``.

        Returns:
            The merged weight in this one's form, or None (the caller then dequantizes,
            applies and encodes): nested absmax, a weight that is not 2-D, columns that are
            not a multiple of ``blocksize`` (blocks straddle rows), or no Triton / no CUDA.
        """
        if self.nested or len(self.shape) != 2:
            return None
        from shuttle.kernels.merge_nf4 import merge_4bit  # the kernels import Triton lazily

        out = merge_4bit(self.packed, self.absmax, self.code, self.shape, self.blocksize, up,
                         down, seg, scales, rounding=rounding, seed=seed,
                         order=_code_order(self.code))
        if out is None:
            return None
        return dataclasses.replace(self, packed=out[0], absmax=out[1])

    # -- bitsandbytes objects ----------------------------------------------------------------

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        if not _is_bnb(tensor):
            return False
        params4bit = _bnb().nn.Params4bit
        return (isinstance(tensor, params4bit) and bool(tensor.bnb_quantized)
                and tensor.quant_state is not None)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Bnb4bitWeight:
        """Wrap a quantized ``Params4bit``; the tensors are shared with it, not copied."""
        qs = tensor.quant_state
        s2 = qs.state2 if qs.nested else None
        return cls(tensor.data, qs.absmax, qs.code, qs.offset if s2 is not None else None,
                   None if s2 is None else s2.absmax, None if s2 is None else s2.code,
                   tuple(qs.shape), int(qs.blocksize), None if s2 is None else int(s2.blocksize),
                   qs.quant_type, qs.dtype)

    def quant_state(self) -> Any:
        """A new ``bitsandbytes.functional.QuantState`` over this representation's tensors."""
        functional = _bnb().functional
        state2 = None
        if self.nested:
            state2 = functional.QuantState(self.nested_absmax, code=self.nested_code,
                                           blocksize=self.nested_blocksize, dtype=torch.float32)
        return functional.QuantState(self.absmax, shape=torch.Size(self.shape), code=self.code,
                                     blocksize=self.blocksize, quant_type=self.quant_type,
                                     dtype=self.dtype, offset=self.offset, state2=state2)

    def to_parameter(self) -> torch.nn.Parameter:
        """A new quantized ``Params4bit`` over this representation's tensors (no copy)."""
        return _bnb().nn.Params4bit(
            self.packed, requires_grad=False, quant_state=self.quant_state(),
            blocksize=self.blocksize, compress_statistics=self.nested,
            quant_type=self.quant_type, quant_storage=self.packed.dtype, bnb_quantized=True)

@register_representation("bnb_int8")
@dataclasses.dataclass
class BnbInt8Weight(WeightRepresentation):
    """A bitsandbytes LLM.int8() weight: int8 rows and one float32 absmax per row.

    Attributes:
        data: int8 ``(rows, cols)``; the weight is ``data * scb[:, None] / 127``.
        scb: float32 ``(rows,)``, each row's absmax (``Int8Params.SCB``).
        compute: the dtype layers compute in (bitsandbytes follows the input; default float16).
    """

    data: torch.Tensor
    scb: torch.Tensor
    compute: torch.dtype = torch.float16

    tensor_names = ("data", "scb")
    # CB too: Linear8bitLt's next forward takes its state (moved into module.state on a
    # forward) from the parameter again
    param_attrs = {"data": ("data", "CB"), "scb": "SCB"}

    def dequantize(self) -> torch.Tensor:
        # Bit for bit bitsandbytes' int8_vectorwise_dequant: it multiplies by 1/127 as float.
        return self.data.float() * self.scb.float().view(-1, 1) * 7.874015718698502e-3

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> BnbInt8Weight:
        x = x.float().reshape(self.data.shape[0], -1)
        scb = x.abs().amax(dim=1)
        # bitsandbytes' own quantization: round(x * (127 / absmax)); a zero row stays zero.
        q = x * (127.0 / torch.where(scb > 0, scb, torch.ones_like(scb))).view(-1, 1)
        if rounding == "nearest":
            q = torch.round(q)
        else:
            lo = q.floor()
            q = _pick(lo, lo + 1, q, lo, lo + 1, rounding, generator)
        data = q.clamp(-127, 127).to(torch.int8).reshape(self.data.shape)
        return dataclasses.replace(self, data=data, scb=scb.to(self.scb.dtype))

    def merge_lowrank(self, up: torch.Tensor, down: torch.Tensor, seg: list[int],
                      scales: list[float], *, rounding: Rounding = "nearest",
                      seed: int = 0) -> BnbInt8Weight | None:
        """``encode(dequantize() + sum_i scales[i] * up[:, seg_i] @ down[seg_i])`` by the fused
        kernel (:func:`shuttle.kernels.merge_scaled.merge_scaled`, ``absmax_scale``), without a
        dense weight.

        Same form as :meth:`encode`: ``SCB`` = each row's absmax (0 for a zero row), codes
        ``round(x * (127 / SCB))``. Nearest rounding equals ``encode`` except where a float32
        rounding (summation order, the kernel's fused dequantize-and-add: see merge_scaled)
        moves a value across a midpoint; stochastic rounding draws from the kernel's stream
        (``seed``, element index).

        Returns:
            The merged weight, or None (the caller then dequantizes, applies and encodes): no
            Triton, not on CUDA (nor interpreted), non-contiguous data, or a merged weight that
            is not finite.
        """
        from shuttle.kernels.merge_scaled import merge_scaled_or_none  # Triton is optional

        out = merge_scaled_or_none(self.data, self.scb, up, down, seg, scales, absmax_scale=True,
                                   rounding=rounding, seed=seed)
        return None if out is None else dataclasses.replace(self, data=out[0], scb=out[1])

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        return _is_bnb(tensor) and isinstance(tensor, _bnb().nn.Int8Params) \
            and tensor.dtype == torch.int8

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> BnbInt8Weight:
        """Wrap a quantized ``Int8Params`` (tensors shared, not copied).

        Raises:
            UnsupportedLayerError: the parameter's ``SCB`` is gone: ``Linear8bitLt`` moves it
                into ``module.state`` on its first forward.
        """
        if getattr(tensor, "SCB", None) is None:
            raise UnsupportedLayerError(
                "this Int8Params has no SCB (row scales): Linear8bitLt moves them into "
                "module.state.SCB on its first forward. Apply adapters before the first forward "
                "(or reload the layer), or use a 4-bit (Params4bit) model")
        return cls(tensor.data, tensor.SCB)

    def to_parameter(self) -> torch.nn.Parameter:
        """A new ``Int8Params`` over this representation's tensors (no copy)."""
        return _bnb().nn.Int8Params(self.data, requires_grad=False, has_fp16_weights=False,
                                    CB=self.data, SCB=self.scb)
