"""Route adapters over several components: which component each adapter key belongs to."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from shuttle.cache import LoRASpec
from shuttle.errors import DuplicateTargetError
from shuttle.formats import LoRA
from shuttle.targets import ModelNames, fused_modules, resolve

__all__ = ["Routed", "route_lora", "route_loras"]

# id(lora) -> (the adapter, component name -> the cache spec of its part there)
Routed = dict[int, tuple[LoRA, dict[str, LoRASpec]]]


def route_loras(pairs: list[tuple[LoRA, float]], components: dict[str, torch.nn.Module],
                routed: Routed, keys: dict[str, str]
                ) -> tuple[Routed, dict[str, list[tuple[LoRASpec, float]]], dict[str, str]]:
    """Route each adapter of ``pairs`` (:func:`route_lora`) into one cache spec per component.

    Args:
        pairs: ``(adapter, strength)`` pairs.
        components: component name -> module.
        routed: an earlier call's specs: an adapter object routed before keeps its specs, so
            that its parts already in the cache stay there.
        keys: component name -> its cache key (its parts' keys are made under it).

    Returns:
        ``(specs, component name -> [(spec, strength), ...], unmatched key -> why)``.

    Raises:
        DuplicateTargetError: one adapter key lands in two components.
    """
    specs: Routed = {}
    unmatched: dict[str, str] = {}
    wanted: dict[str, list[tuple[LoRASpec, float]]] = {}
    for lora, strength in pairs:
        if id(lora) not in specs:
            subs, missed = route_lora(lora, components)
            unmatched.update(missed)
            old = routed.get(id(lora), (lora, {}))[1]
            specs[id(lora)] = (lora, {comp: old.get(comp) or LoRASpec(
                f"{keys[comp]}.lora{id(sub):x}", sub) for comp, sub in subs.items()})
        for comp, spec in specs[id(lora)][1].items():
            wanted.setdefault(comp, []).append((spec, strength))
    return specs, wanted, unmatched


def route_lora(lora: LoRA, components: dict[str, torch.nn.Module]
               ) -> tuple[dict[str, LoRA], dict[str, str]]:
    """Split ``lora`` into one adapter per component it touches.

    The keys are resolved once against all components together, each component's parameter
    names under its own name as a root (``transformer.``, ``text_encoder_2.``, ...): that is
    what lets the resolver's prefix rules choose the component (``lora_te2_`` ->
    ``text_encoder_2``). Each component then gets the adapter restricted to its keys, and that
    restriction is resolved again on the component alone, as :func:`~shuttle.merge_lora` on
    the component would; a key it fails to place is reported too.

    Args:
        lora: the adapter.
        components: component name -> module. With a single component the keys are resolved
            against it directly (no root added).

    Returns:
        ``(per component name -> its adapter, unmatched adapter key -> why)``; components the
        adapter does not touch are absent.

    Raises:
        DuplicateTargetError: one adapter key lands in two components.
    """
    if len(components) == 1:
        (name, module), = components.items()
        res = resolve(lora, module)
        return ({name: lora} if res.targets else {}), dict(res.unmatched)
    names = ModelNames({f"{c}.{n}": p.shape for c, m in components.items()
                        for n, p in m.named_parameters()},
                       {f"{c}.{f}" if f else c for c, m in components.items()
                        for f in fused_modules(m)})
    res = resolve(lora, names)
    owners: dict[str, set[str]] = defaultdict(set)
    for t in res.targets:
        owners[t.module_key].add(t.param.split(".", 1)[0])
    keys: dict[str, list[str]] = defaultdict(list)
    for key, comps in owners.items():
        if len(comps) > 1:
            raise DuplicateTargetError(f"adapter key {key!r} resolves into components "
                                       f"{sorted(comps)}; pass a mapping per component")
        keys[comps.pop()].append(key)
    unmatched = dict(res.unmatched)
    routed = {}
    for comp, ks in keys.items():
        sub = dataclasses.replace(lora, modules={k: lora.modules[k] for k in ks})
        for key, why in resolve(sub, components[comp]).unmatched.items():
            unmatched[key] = f"{comp}: {why}"
        routed[comp] = sub
    return routed, unmatched
