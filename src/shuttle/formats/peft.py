"""PEFT: ``base_model.model.<module>.lora_A/lora_B`` (+ DoRA, embeddings, ``lora_B.bias``), LoHa and
LoKr, with alpha, rsLoRA and per-module patterns from ``adapter_config.json``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from shuttle.errors import AdapterFormatError, UnsupportedFormatError
from shuttle.formats.registry import register_format

__all__ = ["PeftConfig"]

_SUPPORTED = ("LORA", "LOHA", "LOKR")


@register_format(
    "peft", priority=60,
    description="PEFT: base_model.model.<module>.lora_A/lora_B (+ adapter_config.json)",
)
def detect(keys, config):  # noqa: D103
    return config is not None or any(k.startswith("base_model.model.") for k in keys)


@dataclasses.dataclass(frozen=True)
class PeftConfig:
    """The fields of a PEFT ``adapter_config.json`` that change the math.

    Attributes:
        peft_type: ``"LORA"``, ``"LOHA"`` or ``"LOKR"``.
        r: default rank.
        alpha: ``lora_alpha`` (LoRA) or ``alpha`` (LoHa/LoKr).
        use_rslora: scale is alpha / sqrt(r) instead of alpha / r.
        rank_pattern, alpha_pattern: per-module overrides; keys are regexes matched against the
            module name as ``(.*\\.)?(key)$``.
        fan_in_fan_out: the layers store weights transposed (GPT-2 ``Conv1D``).
    """

    peft_type: str = "LORA"
    r: int = 8
    alpha: float = 8.0
    use_rslora: bool = False
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)
    fan_in_fan_out: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "adapter_config.json") -> PeftConfig:
        """Read the relevant fields of a PEFT config dict.

        Raises:
            UnsupportedFormatError: a PEFT type other than LoRA, LoHa or LoKr.
            AdapterFormatError: a field has the wrong type.
        """
        peft_type = str(d.get("peft_type", "LORA")).upper()
        if peft_type not in _SUPPORTED:
            raise UnsupportedFormatError(
                f"{where}: peft_type {peft_type!r} is not supported (supported: "
                f"{', '.join(_SUPPORTED)}). Merge it with PEFT's merge_and_unload() instead."
            )
        alpha_key = "lora_alpha" if peft_type == "LORA" else "alpha"
        try:
            r = int(d.get("r", 8))
            alpha = float(d.get(alpha_key) if d.get(alpha_key) is not None else r)
            cfg = cls(
                peft_type=peft_type, r=r, alpha=alpha,
                use_rslora=bool(d.get("use_rslora", False)),
                rank_pattern={str(k): int(v) for k, v in (d.get("rank_pattern") or {}).items()},
                alpha_pattern={str(k): float(v) for k, v in
                               (d.get("alpha_pattern") or {}).items()},
                fan_in_fan_out=bool(d.get("fan_in_fan_out", False)),
            )
        except (TypeError, ValueError) as e:
            raise AdapterFormatError(f"{where}: invalid field ({e}); fix the config file") from None
        if not math.isfinite(cfg.alpha):
            raise AdapterFormatError(f"{where}: {alpha_key} is {cfg.alpha}; it must be finite")
        return cfg

    def _pattern(self, table: dict[str, Any], module: str) -> Any:
        name = module.removeprefix("base_model.model.")
        for pat, value in table.items():
            if re.match(rf"(.*\.)?({pat})$", name):
                return value
        return None

    def rank_for(self, module: str) -> int:
        """The configured rank of ``module``."""
        r = self._pattern(self.rank_pattern, module)
        return self.r if r is None else r

    def alpha_for(self, module: str) -> float:
        """The configured alpha of ``module``."""
        a = self._pattern(self.alpha_pattern, module)
        return self.alpha if a is None else a

    def scale_for(self, module: str, rank: int) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        a = self.alpha_for(module)
        return a / math.sqrt(rank) if self.use_rslora else a / rank
