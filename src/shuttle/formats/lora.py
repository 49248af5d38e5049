"""The in-memory adapter (:class:`LoRA`) and :func:`load_lora`, which reads any supported format."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from shuttle.errors import AdapterFileError, AdapterFormatError, ShuttleError
from shuttle.formats.assemble import assemble
from shuttle.formats.diffusers import METADATA_KEY
from shuttle.formats.hub import hub_file, looks_like_repo_id
from shuttle.formats.lycoris import DORA_RULE_KEY, written_by_lycoris
from shuttle.formats.peft import PeftConfig
from shuttle.formats.registry import AdapterFormat, detect_format
from shuttle.formats.source import Source, open_source
from shuttle.patches import DoRA, Patch

__all__ = ["DORA_RULES", "DoraRule", "LoRA", "load_lora"]

DoraRule = Literal["lycoris", "comfy"]
# How a strength k enters a dora_scale DoRA, by rule -> the DoRA patch's mode:
#   "lycoris": W' = V + k (D - V)   (LyCORIS's forward and merge)
#   "comfy":   W' = W + k (D - W)   (ComfyUI)
DORA_RULES: dict[str, str] = {"lycoris": "lycoris", "comfy": "blend"}


@dataclasses.dataclass
class LoRA:
    """An adapter in shuttle's exact form: per module, the patches it applies.

    Tensors stay in their file (lazy references) until a merge or ``load()`` reads them.

    Attributes:
        format: the detected format (a key of ``shuttle.formats.FORMATS``).
        modules: adapter module key (as spelled in the file) -> its patches.
        source: where it came from.
        metadata: safetensors ``__metadata__``.
        config: the PEFT config, if any (``adapter_config.json``, ``load_lora(config=...)``, or
            diffusers' flat ``lora_adapter_metadata``).
        skipped: keys that were not turned into patches, with the reason (never silent).
        component_configs: the PEFT configs of a diffusers pipeline file, per component
            (``transformer``, ``unet``, ``text_encoder``, ...): each scales the modules under
            ``<component>.``, with its patterns matched below that prefix.
    """

    format: str
    modules: dict[str, list[Patch]]
    source: str = "<state dict>"
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    config: PeftConfig | None = None
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    component_configs: dict[str, PeftConfig] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {n}" for k, n in self.kinds().items())
        return f"LoRA(format={self.format!r}, modules={len(self)}, {kinds}, source={self.source!r})"

    def patches(self) -> Iterator[tuple[str, Patch]]:
        """Yield ``(module_key, patch)`` for every patch."""
        for module, patches in self.modules.items():
            for p in patches:
                yield module, p

    def kinds(self) -> dict[str, int]:
        """How many patches of each kind."""
        return dict(Counter(p.kind for _, p in self.patches()))

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors in their stored dtypes."""
        return sum(p.nbytes for _, p in self.patches())

    def load(self, device: torch.device | str | None = None) -> LoRA:
        """A copy with every tensor read (and moved to ``device``)."""
        modules = {m: [p.load(device) for p in ps] for m, ps in self.modules.items()}
        return dataclasses.replace(self, modules=modules)

    def with_dora(self, rule: DoraRule) -> LoRA:
        """A copy whose ``dora_scale`` DoRA patches take a strength as ``rule`` says (itself
        when they already do).

        With ``V = W + s * delta`` and ``D = mag * V / ||V||`` (see docs/formats.md), at
        strength ``k``: ``"lycoris"`` gives ``V + k * (D - V)`` (LyCORIS's own forward and
        merge), ``"comfy"`` gives ``W + k * (D - W)`` (ComfyUI). Both give ``D`` at ``k = 1``.
        PEFT's ``lora_magnitude_vector`` DoRA always follows PEFT and is left as it is.

        Raises:
            ShuttleError: ``rule`` is not ``"lycoris"`` or ``"comfy"``.
        """
        mode = _dora_mode(rule)
        if all(not isinstance(p, DoRA) or p.mode in ("inner", mode) for _, p in self.patches()):
            return self
        modules = {m: [dataclasses.replace(p, mode=mode)
                       if isinstance(p, DoRA) and p.mode != "inner" else p for p in ps]
                   for m, ps in self.modules.items()}
        return dataclasses.replace(self, modules=modules)

    def describe(self) -> list[dict[str, Any]]:
        """One row per patch: module, param, kind, rank, alpha, scale, shapes, dtype, bytes."""
        rows = []
        for module, p in self.patches():
            scale = getattr(p, "scale", None)
            if scale is None and hasattr(p, "inner"):
                scale = getattr(p.inner, "scale", None)
            rows.append({
                "module": module, "param": p.param, "kind": p.kind, "rank": p.rank,
                "alpha": p.alpha, "scale": scale, "shapes": p.shapes(),
                "dtype": str(p.dtype).removeprefix("torch."), "bytes": p.nbytes,
            })
        return rows


def load_lora(
    source: Source | LoRA,
    *,
    config: dict[str, Any] | None = None,
    strict: bool = True,
    dora: DoraRule | Literal["auto"] = "auto",
    weight_name: str | None = None,
) -> LoRA:
    """Read an adapter of any supported format.

    Args:
        source: a ``.safetensors`` file, a list of them, a PEFT adapter directory, a
            ``.bin``/``.pt`` file (loaded with ``weights_only=True``), an in-memory state dict,
            a :class:`LoRA` (returned as is), or a Hugging Face Hub repo id ``"owner/name"``
            that is no local path (fetched into the Hub's cache with ``huggingface_hub``; see
            :mod:`shuttle.formats.hub`).
        config: a PEFT ``adapter_config.json`` as a dict, overriding every config found with
            the source (diffusers' per-component ones too): it then scales all modules.
        strict: raise :class:`~shuttle.errors.UnknownKeyError` on keys of no known kind;
            with False they are listed in ``LoRA.skipped`` instead.
        dora: how a strength enters a ``dora_scale`` DoRA (see :meth:`LoRA.with_dora`):
            ``"lycoris"``, ``"comfy"``, or ``"auto"``: ``"lycoris"`` for a file that LyCORIS
            wrote (``lycoris_`` names, or ``ss_network_module`` = ``lycoris.*`` in its
            metadata), else ``"comfy"``, the result ComfyUI users see from such a file. A
            file written by :func:`~shuttle.save_lora` keeps the rule it was saved with.
        weight_name: the file to read in a Hub repo or a local directory (default: a repo's
            only ``.safetensors`` file, or ``pytorch_lora_weights.safetensors``).

    Returns:
        The adapter; only safetensors headers (and 0-dim alphas) have been read.

    Raises:
        AdapterFileError: the source cannot be opened (for a repo id: no such repo or file, or
            the Hub unreachable and the file not cached: the message says how to download it).
        MissingDependencyError: a repo id without ``huggingface_hub`` installed.
        CorruptFileError: a file is truncated or inconsistent.
        UnsupportedFormatError: a recognized format shuttle does not implement (OFT, GLoRA).
        UnknownKeyError: keys of no known kind (with ``strict``).
        AdapterFormatError: malformed adapter (missing partner tensors, bad alpha, no keys).
        ShuttleError: ``dora`` is not one of ``"auto"``, ``"lycoris"``, ``"comfy"``.
    """
    if dora != "auto":
        _dora_mode(dora)
    if isinstance(source, LoRA):
        return source if dora == "auto" else source.with_dora(dora)
    if isinstance(source, (str, os.PathLike)):
        source = _local(source, weight_name)
    elif weight_name is not None:
        raise AdapterFileError(f"weight_name={weight_name!r} is for a repo id or a directory; "
                               "pass the file itself")
    src = open_source(source)
    cfg_dict = config if config is not None else src.config
    peft_cfg = PeftConfig.from_dict(cfg_dict, src.name) if cfg_dict is not None else None
    components = {} if config is not None else {
        name: PeftConfig.from_dict(d, f"{src.name} ({METADATA_KEY}, component {name!r})")
        for name, d in src.component_configs.items()}
    if not src.tensors:
        raise AdapterFormatError(f"{src.name}: holds no tensors; it is not an adapter")
    fmt = detect_format(list(src.tensors), cfg_dict)
    # With no format matched, parsing still runs so the error names the offending keys.
    fmt = fmt or AdapterFormat("unknown", "no registered format matched", lambda k, c: True, 0)
    modules, skipped = assemble(src.tensors, fmt, peft_cfg, components=components,
                                strict=strict, source=src.name)
    if not modules:
        raise AdapterFormatError(f"{src.name}: no key forms an update ({len(skipped)} skipped)")
    lora = LoRA(fmt.name, modules, src.name, src.metadata, peft_cfg, skipped, components)
    if dora == "auto":
        dora = _file_dora_rule(list(src.tensors), src.metadata, src.name)
    return lora.with_dora(dora)


def _local(source: str | os.PathLike[str], weight_name: str | None) -> str | os.PathLike[str]:
    """A path to read: ``source`` itself, ``weight_name`` in a directory, or a Hub repo's file
    fetched into the cache.
    """
    if isinstance(source, str) and looks_like_repo_id(source):
        return hub_file(source, weight_name)
    if weight_name is not None:
        if not Path(source).is_dir():
            raise AdapterFileError(f"weight_name={weight_name!r} needs a directory or a repo "
                                   f"id; {str(source)!r} is neither")
        return Path(source) / weight_name
    return source


def _dora_mode(rule: str) -> str:
    if rule not in DORA_RULES:
        raise ShuttleError(
            f"dora={rule!r}: expected 'lycoris' (LyCORIS's strength rule) or 'comfy' "
            "(ComfyUI's), or 'auto' at load to choose from the file"
        )
    return DORA_RULES[rule]


def _file_dora_rule(keys: list[str], metadata: dict[str, str], name: str) -> DoraRule:
    """The rule of a file's ``dora_scale``: as saved by shuttle, else by who wrote it."""
    saved = metadata.get(DORA_RULE_KEY)
    if saved is not None:
        if saved not in DORA_RULES:
            raise AdapterFormatError(
                f"{name}: metadata {DORA_RULE_KEY}={saved!r} should be 'lycoris' or 'comfy'; "
                "pass dora= to load_lora to choose"
            )
        return saved  # type: ignore[return-value]
    # Not LyCORIS: ComfyUI reads most such files (kohya and OneTrainer DoRA), so its rule.
    return "lycoris" if written_by_lycoris(keys, metadata) else "comfy"
