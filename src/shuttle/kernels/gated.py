"""The gated activation of a GLU MLP and its backward, one elementwise pass each.

A gated MLP computes ``h = act(e) * g`` from its gate projection ``e`` and up projection ``g``
(both ``(..., F)``), with ``act`` one of:

    silu        x * sigmoid(x)                              (SwiGLU: Llama, Mistral, Qwen)
    gelu_tanh   0.5 x (1 + tanh(c (x + 0.044715 x^3))),     (GeGLU: Gemma)
                c = sqrt(2 / pi)
    gelu        0.5 x (1 + erf(x / sqrt(2)))

Given ``dh``, the backward needs ``dg = dh * act(e)`` and ``de = dh * g * act'(e)``, and the
LoRA of the down projection needs ``h`` again (it is not saved: recomputing it here costs no
extra read). :func:`gated_backward` reads ``dh``, ``e`` and ``g`` once and writes ``h``, ``de``
and ``dg``, into the input buffers when asked (each element is read before it is written, at
the same index), so the backward of a whole MLP allocates nothing of size ``(T, F)``.
All math is float32; each output is rounded once to the inputs' dtype.
:func:`gated_forward_reference` and :func:`gated_backward_reference` are the same math in
PyTorch (any device, the CPU fallback, and the oracle of the tests).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from shuttle.kernels.launch import cdiv, interpreting, triton_available

__all__ = ["ACTIVATIONS", "Activation", "gated_backward", "gated_backward_reference",
           "gated_forward", "gated_forward_reference"]

Activation = Literal["silu", "gelu_tanh", "gelu"]
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "gelu")
_CODE = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
_BLOCK = 2048
_C = math.sqrt(2 / math.pi)


# -- references ------------------------------------------------------------------------------

def _act_and_grad(e: torch.Tensor, act: Activation) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(e)`` and ``act'(e)`` in ``e``'s dtype."""
    if act == "silu":
        s = torch.sigmoid(e)
        return e * s, s * (1 + e * (1 - s))
    if act == "gelu_tanh":
        t = torch.tanh(_C * (e + 0.044715 * e ** 3))
        return 0.5 * e * (1 + t), 0.5 * (1 + t) + 0.5 * e * (1 - t * t) * _C * (
            1 + 3 * 0.044715 * e * e)
    if act == "gelu":
        phi = 0.5 * (1 + torch.erf(e / math.sqrt(2)))
        return e * phi, phi + e * torch.exp(-0.5 * e * e) / math.sqrt(2 * math.pi)
    raise ValueError(f"activation {act!r}: expected one of {ACTIVATIONS}")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 for a float64 ``t``."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def gated_forward_reference(e: torch.Tensor, g: torch.Tensor, act: Activation) -> torch.Tensor:
    """``act(e) * g`` in float32 (float64 for float64 inputs), rounded once to ``e``'s dtype."""
    a, _ = _act_and_grad(_wide(e), act)
    return (a * _wide(g)).to(e.dtype)


def gated_backward_reference(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor,
                             act: Activation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, de, dg)`` of :func:`gated_backward`, as new tensors."""
    ef, gf, dhf = _wide(e), _wide(g), _wide(dh)
    a, da = _act_and_grad(ef, act)
    dt = e.dtype
    return (a * gf).to(dt), (dhf * gf * da).to(dt), (dhf * a).to(dt)


# -- the kernels -----------------------------------------------------------------------------

@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _act(e, ACT: tl.constexpr):
        # (act(e), act'(e)) in float32
        if ACT == 0:
            s = tl.sigmoid(e)
            return e * s, s * (1 + e * (1 - s))
        elif ACT == 1:
            c = 0.7978845608028654  # sqrt(2 / pi)
            t = 2 * tl.sigmoid(2 * c * (e + 0.044715 * e * e * e)) - 1  # tanh
            return 0.5 * e * (1 + t), 0.5 * (1 + t) + 0.5 * e * (1 - t * t) * c * (
                1 + 3 * 0.044715 * e * e)
        else:
            phi = 0.5 * (1 + tl.math.erf(e * 0.7071067811865476))
            return e * phi, phi + e * tl.exp(-0.5 * e * e) * 0.3989422804014327

    # Triton resolves the functions a kernel calls among its module's globals (the
    # interpreter re-executes the source with those only): bind the helper there.
    globals()["_act"] = _act

    @triton.jit
    def gated_forward_kernel(e_ptr, g_ptr, h_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(e_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        a, _ = _act(e, ACT)
        tl.store(h_ptr + offs, (a * g).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_backward_kernel(dh_ptr, e_ptr, g_ptr, h_ptr, de_ptr, dg_ptr, n,
                              ACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dh = tl.load(dh_ptr + offs, mask=mask).to(tl.float32)
        e = tl.load(e_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        a, da = _act(e, ACT)
        ty = h_ptr.dtype.element_ty
        tl.store(h_ptr + offs, (a * g).to(ty), mask=mask)
        tl.store(de_ptr + offs, (dh * g * da).to(ty), mask=mask)
        tl.store(dg_ptr + offs, (dh * a).to(ty), mask=mask)

    return gated_forward_kernel, gated_backward_kernel


def _use_kernel(*tensors: torch.Tensor) -> bool:
    # Under torch.compile the references are traced instead: Inductor fuses them itself.
    t = tensors[0]
    return (not torch.compiler.is_compiling() and triton_available()
            and (t.is_cuda or interpreting())
            and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(x.is_contiguous() and x.dtype == t.dtype and x.shape == t.shape
                    for x in tensors))


def _check(act: str) -> int:
    code = _CODE.get(act)
    if code is None:
        raise ValueError(f"activation {act!r}: expected one of {ACTIVATIONS}")
    return code


def gated_forward(e: torch.Tensor, g: torch.Tensor, act: Activation) -> torch.Tensor:
    """``act(e) * g`` (a new tensor of ``e``'s shape and dtype), by one kernel on CUDA.

    Raises:
        ValueError: ``act`` is not one of :data:`ACTIVATIONS`.
    """
    code = _check(act)
    if not _use_kernel(e, g) or e.numel() == 0:
        return gated_forward_reference(e, g, act)
    h = torch.empty_like(e)
    n = e.numel()
    _kernels()[0][(cdiv(n, _BLOCK),)](e, g, h, n, ACT=code, BLOCK=_BLOCK)
    return h


def gated_backward(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, act: Activation, *,
                   in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, de, dg)``: ``h = act(e) * g``, ``de = dh * g * act'(e)``, ``dg = dh * act(e)``.

    With ``in_place``, ``h`` is written into ``dh``, ``de`` into ``e`` and ``dg`` into ``g``
    (the caller owns all three and needs none of them afterwards); otherwise new tensors.

    Raises:
        ValueError: ``act`` is not one of :data:`ACTIVATIONS`.
    """
    code = _check(act)
    if not _use_kernel(dh, e, g) or e.numel() == 0:
        h, de, dg = gated_backward_reference(dh, e, g, act)
        if in_place:
            return dh.copy_(h), e.copy_(de), g.copy_(dg)
        return h, de, dg
    outs = (dh, e, g) if in_place else tuple(torch.empty_like(e) for _ in range(3))
    n = e.numel()
    _kernels()[1][(cdiv(n, _BLOCK),)](dh, e, g, *outs, n, ACT=code, BLOCK=_BLOCK)
    return outs
