"""Write a :class:`LoRA` in another tool's spelling: ``peft``, ``kohya`` or ``comfy``.

Tensors are written unchanged; only names change, and each low-rank patch's scale is stored as
``alpha = scale * rank`` (float64) so that reading the file back gives the same scale. What a
target format cannot express raises :class:`~shuttle.errors.UnsupportedFormatError` before
anything is written. The ``kohya``/``comfy`` keys of each patch are its kind's spelling
(:meth:`shuttle.patches.PatchKind.spell`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from shuttle.errors import AdapterFileError, UnsupportedFormatError
from shuttle.formats.kohya import KOHYA_PREFIXES
from shuttle.formats.lora import DORA_RULES, LoRA
from shuttle.formats.lycoris import DORA_RULE_KEY
from shuttle.formats.safetensors_writer import create_temp, publish_mode
from shuttle.patches import Diff, DoRA, LowRank, materialize
from shuttle.patches.experts import NOT_WRITTEN
from shuttle.patches.kind import spell_patch

__all__ = ["PIPELINE_COMPONENTS", "TARGETS", "pipeline_components", "save_lora"]

Target = Literal["peft", "kohya", "comfy"]
TARGETS: tuple[str, ...] = ("peft", "kohya", "comfy")

# The pipeline components diffusers prefixes LoRA keys with (``_lora_loadable_modules`` of its
# pipelines); a file's own per-component configs name more.
PIPELINE_COMPONENTS = ("transformer", "transformer_2", "transformer_ref", "unet", "text_encoder",
                       "text_encoder_2", "text_encoder_3", "connectors", "text_conditioner")


def pipeline_components(lora: LoRA) -> dict[str, int]:
    """Pipeline component -> how many module keys of ``lora`` lie under ``<component>.``.

    A diffusers pipeline file (``save_lora_weights``) prefixes each key with the component it
    adapts (``transformer.``, ``text_encoder.``, ...); keys under no such prefix count under
    ``""``. Files of one model (PEFT, a model's ``save_lora_adapter`` with its flat config,
    kohya, ...) have module paths that may start with such a word (GPT-2's ``transformer.h``),
    so for them the result is ``{}``; a diffusers model file with a flat config reads as
    ``peft``, one without any config cannot be told from a pipeline file.
    """
    if lora.format != "diffusers":
        return {}
    known = {*PIPELINE_COMPONENTS, *lora.component_configs}
    counts: dict[str, int] = {}
    for module in lora.modules:
        head, dot, _ = module.partition(".")
        component = head if dot and head in known else ""
        counts[component] = counts.get(component, 0) + 1
    return {} if set(counts) == {""} else counts


def _one_component(lora: LoRA, component: str | None) -> tuple[LoRA, str]:
    """The modules one PEFT directory holds, and the ``<component>.`` prefix they lose: a PEFT
    adapter adapts one model, whose module paths do not start with a pipeline's component.
    """
    found = pipeline_components(lora)
    listing = ", ".join(f"{c or '(no component)'} ({n} modules)" for c, n in sorted(found.items()))
    if component is None:
        if not found:
            return lora, ""
        if len(found) > 1:
            raise UnsupportedFormatError(
                f"the adapter holds modules of several pipeline components: {listing}; a PEFT "
                "adapter adapts one model. Name the one to write: --component NAME "
                "(save_lora(..., component=NAME)), once per component.")
        component = next(iter(found))
    elif component not in found or not component:
        raise UnsupportedFormatError(
            f"component={component!r}: the adapter has " +
            (f"modules of {listing}; name one of those" if found else
             "no pipeline components (its keys are one model's); leave component out"))
    prefix = f"{component}."
    return dataclasses.replace(
        lora, modules={m: ps for m, ps in lora.modules.items() if m.startswith(prefix)}), prefix


# Component prefixes and the kohya prefix each becomes.
_KOHYA_OF_PREFIX = {
    "text_encoder_3.": "lora_te3_", "text_encoder_2.": "lora_te2_", "text_encoder.": "lora_te1_",
    "base_model.model.": "lora_unet_", "diffusion_model.": "lora_unet_",
    "transformer.": "lora_unet_", "unet.": "lora_unet_", "model.": "lora_unet_",
}


def _kohya_name(module: str) -> str:
    if module.startswith(KOHYA_PREFIXES):
        return module
    for prefix, kohya in _KOHYA_OF_PREFIX.items():
        if module.startswith(prefix):
            return kohya + module[len(prefix):].replace(".", "_")
    return "lora_unet_" + module.replace(".", "_")


def _peft_names(lora: LoRA, mapping: Mapping[str, str] | None,
                component: str = "") -> dict[str, str]:
    """Module key -> the module path PEFT keys need: the key less its pipeline ``component``
    prefix, unless ``mapping`` names it. kohya keys spell paths with ``_`` for ``.``
    (``lora_unet_down_blocks_0`` is ``down_blocks.0`` or ``down.blocks_0``): only a mapping
    (made by the caller from the model the keys resolve against) names the modules.
    """
    names = mapping or {}
    return {module: names.get(module, module.removeprefix(component))
            for module in lora.modules}


def _check_path(module: str, path: str) -> None:
    if path.removeprefix("base_model.model.").startswith(KOHYA_PREFIXES):
        raise UnsupportedFormatError(
            f"module {module!r} has a kohya name, with '_' for each '.' of a module path; "
            "PEFT keys need the module path itself, which the file alone does not give, and "
            "neither PEFT nor shuttle could apply the result. Convert to kohya or comfy instead, "
            "or, in Python, pass mapping={kohya name: module path}, made from the model the "
            "adapter is for: {t.module_key: t.param.rpartition('.')[0] for t in "
            "shuttle.resolve(lora, model).targets if t.rows is None}."
        )


def _peft_tensors(lora: LoRA, names: Mapping[str, str]) -> tuple[dict[str, torch.Tensor], dict]:
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    use_dora = lora_bias = False
    for module, p in lora.patches():
        path = names[module]
        base = path if path.startswith("base_model.model.") else f"base_model.model.{path}"
        inner = p.inner if isinstance(p, DoRA) else p
        if isinstance(p, Diff) and p.param == "bias":
            # PEFT's reader scales lora_B.bias by the module's LoRA scale (1 without a LoRA).
            main = next((q for q in lora.modules[module] if q.param == "weight"), None)
            main = main.inner if isinstance(main, DoRA) else main
            if p.scale != getattr(main, "scale", 1.0):
                raise UnsupportedFormatError(
                    f"module {module!r}: a bias delta with scale {p.scale} beside a LoRA of "
                    f"scale {getattr(main, 'scale', 1.0)} has no PEFT spelling (lora_B.bias takes "
                    "the LoRA's scale); convert to comfy instead."
                )
            _check_path(module, path)
            tensors[f"{base}.lora_B.bias"] = materialize(p.diff)
            lora_bias = True
            continue
        if p.kind == "experts_lora":
            raise UnsupportedFormatError(
                f"module {module!r}: {NOT_WRITTEN}")
        if not isinstance(inner, LowRank) or inner.mid is not None or inner.split_qkv:
            raise UnsupportedFormatError(
                f"module {module!r}: a {p.kind} patch has no PEFT LoRA spelling; convert to "
                "comfy (which spells every kind) instead."
            )
        if isinstance(p, DoRA) and p.mode != "inner":
            raise UnsupportedFormatError(
                f"module {module!r}: a dora_scale takes strength differently from PEFT's "
                "magnitude vector; keep it in kohya or comfy spelling."
            )
        _check_path(module, path)
        # Transposed factors (embeddings, fan_in_fan_out) use PEFT's embedding spelling, which
        # reads back as the same transposed product.
        emb = "embedding_" if inner.transposed else ""
        tensors[f"{base}.lora_{emb}A{'' if emb else '.weight'}"] = materialize(inner.down)
        tensors[f"{base}.lora_{emb}B{'' if emb else '.weight'}"] = materialize(inner.up)
        if isinstance(p, DoRA):
            use_dora = True
            tensors[f"{base}.lora_magnitude_vector"] = materialize(p.magnitude)
        name = path.removeprefix("base_model.model.")
        ranks[name] = inner.rank
        alphas[name] = inner.scale * inner.rank
    r = max(ranks.values(), default=8)
    config = {
        "peft_type": "LORA", "r": r, "lora_alpha": float(r), "use_rslora": False,
        "use_dora": use_dora, "target_modules": sorted(ranks),
        "rank_pattern": {_exact(m): v for m, v in ranks.items() if v != r},
        "alpha_pattern": {_exact(m): v for m, v in alphas.items() if v != float(r)},
        "fan_in_fan_out": False, "lora_bias": lora_bias,
    }
    return tensors, config


def _exact(module: str) -> str:
    # PEFT matches pattern keys as regexes "(.*\.)?(key)$"; anchor at the full module name.
    return "^" + module.replace(".", r"\.")


def save_lora(lora: LoRA, path: str | os.PathLike[str], to: Target = "comfy", *,
              mapping: Mapping[str, str] | None = None, component: str | None = None) -> Path:
    """Write ``lora`` in the spelling of ``to``.

    Args:
        lora: the adapter.
        path: a ``.safetensors`` file for ``kohya`` and ``comfy``; a directory for ``peft``
            (``adapter_model.safetensors`` + ``adapter_config.json``).
        to: ``"peft"``, ``"kohya"`` or ``"comfy"``.
        mapping: for ``peft`` only: module key -> module path, the path each module key is
            written under (needed for kohya names). This module reads no model: the caller
            resolves the keys against the model the adapter is for,
            ``{t.module_key: t.param.rpartition(".")[0] for t in
            shuttle.resolve(lora, model).targets if t.rows is None}``.
        component: for ``peft`` only: of a diffusers pipeline file (keys ``transformer.``,
            ``text_encoder.``, ... :func:`pipeline_components`), the component to write; its
            prefix is dropped, as PEFT names modules inside the one model it adapts. Needed
            when the file holds several components; one alone is taken without it.

    Files are written to a temporary name beside ``path`` (``.shuttle-partial.*``) and
    renamed, with the mode of any new file (0666 less the umask).

    Returns:
        The path of the written weight file.

    Raises:
        UnsupportedFormatError: a patch has no spelling in ``to``; or (``peft``) a module has a
            kohya name that ``mapping`` does not turn into a path, the file holds
            several pipeline components and ``component`` names none of them, or
            ``component`` is given for a file without components; nothing is written.
        AdapterFileError: ``path`` is a directory or not ``*.safetensors`` (``kohya``/``comfy``),
            or a file (``peft``).
        ValueError: ``to`` is not one of :data:`TARGETS`.
    """
    path = Path(path)
    if to == "peft":
        if path.exists() and not path.is_dir():
            raise AdapterFileError(
                f"{path}: is a file; --to peft writes a directory (adapter_model.safetensors + "
                "adapter_config.json). Name a directory instead.")
        lora, prefix = _one_component(lora, component)
        tensors, config = _peft_tensors(lora, _peft_names(lora, mapping, prefix))
        path.mkdir(parents=True, exist_ok=True)
        out = path / "adapter_model.safetensors"
        _save(tensors, out, lora)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        return out
    namer: Callable[[str], str]
    if to == "kohya":
        namer = _kohya_name
    elif to == "comfy":
        namer = lambda m: m.removeprefix("base_model.model.")  # noqa: E731
    else:
        raise ValueError(f"to={to!r}: expected one of {TARGETS}")
    if component is not None:
        raise UnsupportedFormatError(
            f"component={component!r} is for to='peft' (one model's adapter); a {to} file "
            "keeps every component under its own prefix. Leave component out.")
    if path.is_dir():
        raise AdapterFileError(
            f"{path}: is a directory; --to {to} writes one file. Name a .safetensors file, "
            f"e.g. {path / 'adapter.safetensors'}.")
    if path.suffix != ".safetensors":
        raise AdapterFileError(
            f"{path}: --to {to} writes safetensors, which readers recognize by the "
            f".safetensors suffix; name the file {path.with_suffix('.safetensors').name}.")
    tensors = {}
    for module, p in lora.patches():
        name = namer(module)
        for k, v in spell_patch(name, p, to).items():
            if k in tensors:
                raise UnsupportedFormatError(
                    f"modules map to the same {to} key {k!r}; convert to another format"
                )
            tensors[k] = v
    _save(tensors, path, lora)
    return path


def _save(tensors: dict[str, torch.Tensor], path: Path, lora: LoRA) -> None:
    meta = {"shuttle_source_format": lora.format}
    # A dora_scale's strength rule, which the new names and metadata may no longer show.
    rules = {r for r, mode in DORA_RULES.items() for _, p in lora.patches()
             if isinstance(p, DoRA) and p.mode == mode}
    if len(rules) > 1:
        raise UnsupportedFormatError(
            "the adapter's dora_scale patches take strength by both LyCORIS's and ComfyUI's rule; "
            "one file records one rule. Use lora.with_dora('lycoris' or 'comfy') first."
        )
    if rules:
        meta[DORA_RULE_KEY] = rules.pop()
    tmp = create_temp(path)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        publish_mode(tmp)  # save_file creates 0600; give it a new file's mode, as merge does
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
