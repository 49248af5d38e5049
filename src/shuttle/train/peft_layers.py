"""What :func:`~shuttle.train.accelerate` can take over, read from the model without importing
peft: PEFT's LoRA layers (by their attributes), why a layer or its active adapter keeps PEFT's
forward, the gated MLP classes and sibling projection groups it fuses, whether one input feeds a
group's projections, and which activation a module computes.
"""

from __future__ import annotations

import inspect
import re

import torch

from shuttle.errors import UnsupportedBaseError
from shuttle.hooks import hooks_of
from shuttle.kernels.gated import ACTIVATIONS, gated_forward_reference
from shuttle.train.frozen import frozen_linear
from shuttle.weights.upcast import UpcastHook

__all__ = ["GATED_MLPS", "PROJECTION_GROUPS", "activation", "adapter_reason", "is_peft_lora",
           "one_input", "static_reason"]

# Gated MLP classes whose forward is down(act(gate(x)) * up(x)) -> (gate, up, down, act) names.
GATED_MLPS: dict[str, tuple[str, str, str, str]] = {
    name: ("gate_proj", "up_proj", "down_proj", "act_fn") for name in (
        "LlamaMLP", "MistralMLP", "MixtralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP",
        "Qwen3MoeMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP", "OlmoMLP", "Olmo2MLP",
        "GraniteMLP", "CohereMLP", "Ministral3MLP", "SmolLM3MLP", "HunYuanDenseV1MLP",
    )
}

# Sibling projections that attention modules call on one input.
PROJECTION_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("to_q", "to_k", "to_v"),
    ("add_q_proj", "add_k_proj", "add_v_proj"), ("query", "key", "value"),
)


def is_peft_lora(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer (``peft.tuners.lora.layer.LoraLayer``'s
    attributes; peft is not imported).
    """
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B", "scaling",
                                              "lora_dropout", "active_adapters"))


def static_reason(module: torch.nn.Module) -> str | None:
    """Why a PEFT LoRA layer can never take the fast path (None: it can, by its build)."""
    base = module.base_layer
    param = getattr(module, "parameter_name", None)
    if param is not None:  # PEFT's ParamWrapper: LoRA on one stacked (experts, in, out) tensor
        while getattr(base, "parameter_name", None) is not None:
            base = base.base_layer
        return (f"LoRA on the stacked expert parameter {param!r} of {type(base).__name__} "
                "(PEFT's target_parameters: grouped expert GEMMs keep PEFT's forward)")
    if not isinstance(base, torch.nn.Linear):
        return f"a {type(base).__name__} base layer (the fast path takes Linear layers)"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    if base._forward_hooks or base._forward_pre_hooks or hasattr(base, "_hf_hook") \
            or any(not isinstance(h, UpcastHook) for h in hooks_of(base)):
        return "the base layer has forward hooks (offloading per layer?)"
    try:
        frozen_linear(base)
    except UnsupportedBaseError as e:
        return str(e)
    return None


def adapter_reason(module: torch.nn.Module, name: str) -> str | None:
    """Why adapter ``name`` of a PEFT LoRA layer cannot take the fast path (None: it can)."""
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name):
        return "a LoRA variant (DoRA, ...)"
    a, b = module.lora_A[name], module.lora_B[name]
    if not (isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear)):
        return "LoRA factors that are not Linear layers"
    if b.bias is not None or a.bias is not None:
        return "a LoRA bias"
    drop = module.lora_dropout[name]
    if not isinstance(drop, (torch.nn.Dropout, torch.nn.Identity)):
        return f"a {type(drop).__name__} dropout"
    return None


def one_input(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Whether the code calling ``module``'s projections ``names`` (its forward, or its
    attention processor's ``__call__``) passes every one of them the same variable, as in
    ``self.q_proj(hidden_states)``, ``self.k_proj(hidden_states)``, ...
    """
    sources = [type(module).forward]
    processor = getattr(module, "processor", None)
    if processor is not None:
        sources.append(type(processor).__call__)
    for fn in sources:
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        args = set()
        for name in names:
            found = re.findall(rf"(?:self|attn)\.{name}\(\s*([A-Za-z_]\w*)\s*\)", src)
            if not found:
                break
            args.update(found)
        else:
            if len(args) == 1:
                return True
    return False


def activation(act: object) -> str | None:
    """Which of :data:`~shuttle.kernels.gated.ACTIVATIONS` ``act`` computes, measured on a probe
    in float64 (a class name does not say which GELU it is), or None.
    """
    probe = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = act(probe)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - any failure means "not one we know"
        return None
    for name in ACTIVATIONS:
        want = gated_forward_reference(probe, torch.ones_like(probe), name)  # type: ignore[arg-type]
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-9, atol=1e-12):
            return name
    return None
