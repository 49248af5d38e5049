"""The frozen base weight of a LoRA layer, as the training functions read it.

A :class:`FrozenLinear` stands for the base ``nn.Linear`` (or bitsandbytes ``Linear4bit``) under
an adapter: ``weight(dtype)`` gives its ``(N, K)`` weight in the compute dtype, ``bias`` its
bias. Plain bfloat16/float16/float32 weights are used as they are. A 4-bit weight (NF4/FP4) is
dequantized when a product needs it (forward, and again in backward) by bitsandbytes' own
kernel, and dropped as soon as that product is queued: the caching allocator hands the same
block to the next layer's weight, so a whole model's backward holds one dequantized weight at a
time. A float8 weight is upcast the same way (:func:`shuttle.kernels.upcast`).

A backward reads the weight its forward used: the functions save ``data`` (the stored tensor,
detached) with ``save_for_backward`` and rebuild the view with :meth:`FrozenLinear.with_data`,
never reading the module's attribute again. A layer whose parameter is rebound in between (an
offloaded block streamed again) is then still differentiated against the right weight, and one
whose storage was overwritten in place raises :class:`~shuttle.errors.TrainingError` rather
than give a wrong gradient: each function records the weights' version counters
(:func:`versions`) and its backward compares them (:func:`check_unchanged`) before it reads
anything (autograd's own check of the saved tensors stays behind it, and is what a compiled
graph keeps).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shuttle.errors import TrainingError, UnsupportedBaseError
from shuttle.kernels.upcast import upcast
from shuttle.weights.fp8 import FP8_DTYPES

__all__ = ["COMPUTE_DTYPES", "FrozenLinear", "check_frozen", "check_unchanged", "frozen_linear",
           "versions"]

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class FrozenLinear:
    """A frozen base linear layer: ``y = x @ weight(x.dtype).T + bias``.

    Attributes:
        kind: ``"plain"``, ``"4bit"`` or ``"float8"``.
        data: the stored weight, detached (for 4-bit: the packed bytes).
        bias: the bias, or None.
        out_features, in_features: the logical shape ``(N, K)``.
    """

    kind: str
    data: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    quant_state: Any = None

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``(N, K)`` weight in ``dtype`` (the stored tensor itself when it already is)."""
        w = self.data
        if self.kind == "plain":
            return w if w.dtype == dtype else w.to(dtype)
        if self.kind == "float8":
            return upcast(w, dtype)
        import bitsandbytes.functional as bnbf  # only 4-bit layers get here

        return bnbf.dequantize_4bit(w, self.quant_state).to(dtype).view(
            self.out_features, self.in_features)

    def with_data(self, data: torch.Tensor) -> FrozenLinear:
        """This layer over ``data`` (the saved tensor that stands for :attr:`data`)."""
        return FrozenLinear(self.kind, data, self.bias, self.out_features, self.in_features,
                            self.quant_state)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a product with ``x`` can run here: ``x`` a float tensor on the weight's
        device, and of the weight's dtype for a plain weight (as ``F.linear`` requires).
        """
        return (x.device == self.data.device and x.dtype in COMPUTE_DTYPES
                and (self.kind != "plain" or x.dtype == self.data.dtype))


def frozen_linear(layer: torch.nn.Module) -> FrozenLinear:
    """The :class:`FrozenLinear` of ``layer``'s current weight.

    Raises:
        UnsupportedBaseError: ``layer`` is not an ``nn.Linear`` with a frozen weight of a
            plain float, float8 or bitsandbytes 4-bit form (the reason says which).
    """
    if not isinstance(layer, torch.nn.Linear):
        raise UnsupportedBaseError(f"a {type(layer).__name__} base layer (only nn.Linear and "
                                   "bitsandbytes Linear4bit have the fast path)")
    params = layer._parameters  # what attribute access falls back to (read at every call)
    w = params.get("weight")
    if w is None:  # a parametrized weight: a property
        w = layer.weight
    if w.requires_grad:
        raise UnsupportedBaseError("the base weight is trainable (requires_grad): the fast "
                                   "path treats it as frozen")
    bias = params.get("bias")
    if bias is None and "bias" not in params:
        bias = layer.bias
    if bias is not None and bias.requires_grad:
        raise UnsupportedBaseError("the base bias is trainable")
    n, k = layer.out_features, layer.in_features
    if type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype in COMPUTE_DTYPES:
        return FrozenLinear("plain", w.detach(), bias, n, k)  # the common case, checked first
    state = getattr(w, "quant_state", None)
    if state is not None:
        if not getattr(w, "bnb_quantized", True):
            raise UnsupportedBaseError("a bitsandbytes weight not yet quantized (move the model "
                                       "to its device first)")
        if getattr(state, "quant_type", None) not in ("nf4", "fp4"):
            raise UnsupportedBaseError(f"a bitsandbytes weight of quant type "
                                       f"{getattr(state, 'quant_type', None)!r}")
        return FrozenLinear("4bit", w.data, bias, n, k, state)
    if w.dtype in FP8_DTYPES:
        return FrozenLinear("float8", w.detach(), bias, n, k)
    if type(w) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedBaseError(f"a {type(w).__name__} weight (a quantized form the fast "
                                   "path does not read)")
    if w.dtype not in COMPUTE_DTYPES:
        raise UnsupportedBaseError(f"a {w.dtype} weight")
    return FrozenLinear("plain", w.detach(), bias, n, k)


def check_frozen(where: str, *bases: object) -> None:
    """Raise unless every one of ``bases`` is a :class:`FrozenLinear` (what the training
    functions take as a base layer).

    Raises:
        UnsupportedBaseError: a base that is not one (an ``nn.Linear`` passed as it is); the
            message names ``where`` and the fix, :func:`frozen_linear`.
    """
    for base in bases:
        if not isinstance(base, FrozenLinear):
            raise UnsupportedBaseError(
                f"{where}: a base layer is a {type(base).__name__}, not a FrozenLinear; pass "
                "shuttle.train.frozen_linear(layer) for each frozen nn.Linear (it reads the "
                "layer's weight and bias once, and checks that they are frozen)")


def versions(bases: tuple[FrozenLinear, ...]) -> tuple[int, ...] | None:
    """The version counters of ``bases``' stored weights, for :func:`check_unchanged` (None
    while Dynamo traces: a traced graph keeps autograd's own check of the saved tensors).
    """
    if torch.compiler.is_compiling():
        return None
    return tuple(b.data._version for b in bases)


def check_unchanged(where: str, bases: tuple[FrozenLinear, ...],
                    before: tuple[int, ...] | None) -> None:
    """Raise if a weight of ``bases`` was written in place since :func:`versions` gave
    ``before`` (in the forward whose backward calls this).

    Raises:
        TrainingError: one was (a gradient taken now would be taken against the new values).
    """
    if before is None or torch.compiler.is_compiling():
        return
    for b, v in zip(bases, before, strict=True):
        if b.data._version != v:
            raise TrainingError(
                f"{where}: the frozen base weight of shape ({b.out_features}, "
                f"{b.in_features}) was changed in place between the forward and its backward "
                "(an optimizer step, a merge or a load into it), so the gradients would be "
                "taken against the new values. Run backward before changing base weights, or "
                "give the layer a new tensor (layer.weight = nn.Parameter(new, "
                "requires_grad=False)) instead of writing into the one in use.")
