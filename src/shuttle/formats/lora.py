"""The in-memory adapter (:class:`LoRA`) and :func:`load_lora`, which reads any supported format."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from shuttle.errors import AdapterFormatError
from shuttle.formats.assemble import assemble
from shuttle.formats.peft import PeftConfig
from shuttle.formats.registry import AdapterFormat, detect_format
from shuttle.formats.source import Source, open_source
from shuttle.patches import Patch

__all__ = ["LoRA", "load_lora"]


@dataclasses.dataclass
class LoRA:
    """An adapter in shuttle's exact form: per module, the patches it applies.

    Tensors stay in their file (lazy references) until a merge or ``load()`` reads them.

    Attributes:
        format: the detected format (a key of ``shuttle.formats.FORMATS``).
        modules: adapter module key (as spelled in the file) -> its patches.
        source: where it came from.
        metadata: safetensors ``__metadata__``.
        config: the PEFT config, if any.
        skipped: keys that were not turned into patches, with the reason (never silent).
    """

    format: str
    modules: dict[str, list[Patch]]
    source: str = "<state dict>"
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    config: PeftConfig | None = None
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

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
) -> LoRA:
    """Read an adapter of any supported format.

    Args:
        source: a ``.safetensors`` file, a list of them, a PEFT adapter directory, a
            ``.bin``/``.pt`` file (loaded with ``weights_only=True``), an in-memory state dict,
            or a :class:`LoRA` (returned as is).
        config: a PEFT ``adapter_config.json`` as a dict, overriding one found with the source.
        strict: raise :class:`~shuttle.errors.UnknownKeyError` on keys of no known kind;
            with False they are listed in ``LoRA.skipped`` instead.

    Returns:
        The adapter; only safetensors headers (and 0-dim alphas) have been read.

    Raises:
        AdapterFileError: the source cannot be opened.
        CorruptFileError: a file is truncated or inconsistent.
        UnsupportedFormatError: a recognized format shuttle does not implement (OFT, GLoRA).
        UnknownKeyError: keys of no known kind (with ``strict``).
        AdapterFormatError: malformed adapter (missing partner tensors, bad alpha, no keys).
    """
    if isinstance(source, LoRA):
        return source
    src = open_source(source)
    cfg_dict = config if config is not None else src.config
    peft_cfg = PeftConfig.from_dict(cfg_dict, src.name) if cfg_dict is not None else None
    if not src.tensors:
        raise AdapterFormatError(f"{src.name}: holds no tensors; it is not an adapter")
    fmt = detect_format(list(src.tensors), cfg_dict)
    # With no format matched, parsing still runs so the error names the offending keys.
    fmt = fmt or AdapterFormat("unknown", "no registered format matched", lambda k, c: True, 0)
    modules, skipped = assemble(src.tensors, fmt, peft_cfg, strict=strict, source=src.name)
    if not modules:
        raise AdapterFormatError(f"{src.name}: no key forms an update ({len(skipped)} skipped)")
    return LoRA(fmt.name, modules, src.name, src.metadata, peft_cfg, skipped)
