"""PEFT: ``base_model.model.<module>.lora_A/lora_B`` (+ DoRA, embeddings, ``lora_B.bias``), LoHa and
LoKr, with alpha, rsLoRA and per-module patterns from ``adapter_config.json``.

Besides the factors PEFT saves some trained tensors whole, as plain
``base_model.model.<module>.<param>`` keys: the modules named in ``modules_to_save`` (a head, an
embedding) and, with ``bias="all"``/``"lora_only"``, biases (``<module>.base_layer.bias`` for a
LoRA layer's own). Only the config tells them apart from a model checkpoint's keys:
:meth:`PeftConfig.saved_whole` says which they are (see :class:`~shuttle.patches.Replace`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shuttle.errors import AdapterFormatError, UnsupportedFormatError
from shuttle.formats.peft_patterns import compile_key
from shuttle.formats.registry import register_format

__all__ = ["PeftConfig"]

_SUPPORTED = ("LORA", "LOHA", "LOKR")


@register_format(
    "peft", priority=60,
    description="PEFT: base_model.model.<module>.lora_A/lora_B (+ adapter_config.json)",
    lokr_layout="peft",
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
            module name as ``(.*\\.)?(key)$`` (PEFT's ``get_pattern_key``), in linear time:
            see :mod:`shuttle.formats.peft_patterns` for what is accepted.
        fan_in_fan_out: the layers store weights transposed (GPT-2 ``Conv1D``).
        modules_to_save: module names whose trained copies the file holds whole; a module
            matches as PEFT matches it, when its name (or a module above it) ends with one.
        bias: ``"none"``, ``"all"`` or ``"lora_only"``: which trained biases the file holds.
        target_modules: the config's ``target_modules``: module names (a module matches when
            its name is one or ends with ``"." + one``), one regular expression matched
            against the whole name, or None.
        target_parameters: the config's ``target_parameters``: parameters (``"down_proj"``,
            ``"mlp.experts.down_proj"``) adapted in place by a ``ParamWrapper``, per expert
            on a stacked MoE tensor. Its factors are saved under the module's name, one more
            ``.base_layer`` for each wrapper nested inside the outermost.
        trainable_token_indices: the embedding rows (token ids) PEFT trained and saved as
            ``<module>.token_adapter.trainable_tokens_delta``: per module name (matched as a
            dotted suffix), or one list for the model's input embedding.
    """

    peft_type: str = "LORA"
    r: int = 8
    alpha: float = 8.0
    use_rslora: bool = False
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)
    fan_in_fan_out: bool = False
    modules_to_save: tuple[str, ...] = ()
    bias: str = "none"
    target_modules: tuple[str, ...] | str | None = None
    target_parameters: tuple[str, ...] = ()
    trainable_token_indices: dict[str, tuple[int, ...]] | tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "adapter_config.json") -> PeftConfig:
        """Read the relevant fields of a PEFT config dict.

        Raises:
            UnsupportedFormatError: a PEFT type other than LoRA, LoHa or LoKr.
            AdapterFormatError: a field has the wrong type.
        """
        if not isinstance(d, dict):
            raise AdapterFormatError(
                f"{where}: the PEFT config is a {type(d).__name__}; it must be a JSON object "
                '(a dict such as {"r": 8, "lora_alpha": 8}). Fix the config file.'
            )
        peft_type = str(d.get("peft_type", "LORA")).upper()
        if peft_type not in _SUPPORTED:
            raise UnsupportedFormatError(
                f"{where}: peft_type {peft_type!r} is not supported (supported: "
                f"{', '.join(_SUPPORTED)}). Merge it with PEFT's merge_and_unload() instead."
            )
        alpha_key = "lora_alpha" if peft_type == "LORA" else "alpha"
        r = _rank(d.get("r", 8), "r", where)
        alpha = _alpha(d.get(alpha_key) if d.get(alpha_key) is not None else r, alpha_key, where)
        rank_pattern = {str(k): _rank(v, f"rank_pattern[{k!r}]", where)
                        for k, v in _table(d, "rank_pattern", where).items()}
        alpha_pattern = {str(k): _alpha(v, f"alpha_pattern[{k!r}]", where)
                         for k, v in _table(d, "alpha_pattern", where).items()}
        try:
            cfg = cls(
                peft_type=peft_type, r=r, alpha=alpha,
                use_rslora=bool(d.get("use_rslora", False)),
                rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                fan_in_fan_out=bool(d.get("fan_in_fan_out", False)),
                modules_to_save=tuple(str(m) for m in (d.get("modules_to_save") or ())),
                bias=str(d.get("bias") or "none"),
                target_modules=_targets(d.get("target_modules"), where),
                target_parameters=tuple(
                    str(t) for t in _names(d.get("target_parameters"), "target_parameters",
                                           where)),
                trainable_token_indices=_token_indices(d.get("trainable_token_indices"), where),
            )
        except (TypeError, ValueError) as e:
            raise AdapterFormatError(f"{where}: invalid field ({e}); fix the config file") from None
        for pat in (*cfg.rank_pattern, *cfg.alpha_pattern):
            compile_key(pat, where)  # refuse what cannot be matched safely, at load
        if isinstance(cfg.target_modules, str):
            compile_key(cfg.target_modules, where, whole=True)
        return cfg

    def saved_whole(self, module: str, param: str) -> tuple[str, str | None] | None:
        """Where key ``<module>.<param>`` lands if the config says PEFT saved it whole.

        Returns:
            None for a key the config does not save whole; else ``(target module, wrapper)``.
            A ``modules_to_save`` copy keeps its path; a trained bias of a LoRA layer is saved
            under the wrapper's ``base_layer``, which is dropped. ``wrapper`` names the
            ``ModulesToSaveWrapper`` level the key spells, if any (``bias="all"`` saves every
            bias of the wrapper too): ``"modules_to_save"`` (the copy again, dropped from the
            target) or ``"original_module"`` (the untouched original, which PEFT's merge
            discards).
        """
        name = module.removeprefix("base_model.model.")
        root = module[: len(module) - len(name)]
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            # PEFT wraps every module whose name ends with an entry (a plain string suffix)
            if any(".".join(parts[:i]).endswith(t) for t in self.modules_to_save):
                level = parts[i] if i < len(parts) else None
                if level in ("modules_to_save", "original_module"):
                    return root + ".".join(parts[:i] + parts[i + 1:]), level
                return module, None
        if self.bias in ("all", "lora_only") and param == "bias":
            while module.endswith(".base_layer"):
                module = module[: -len(".base_layer")]
            return module, None
        return None

    def wrapped_parameter(self, module: str) -> tuple[str, int, tuple[str, ...]] | None:
        """Whether module key ``module`` holds the factors of a ``ParamWrapper``, and of which.

        Returns:
            None for an ordinary LoRA layer; else ``(module, depth, names)``: the adapted
            module's key (``.base_layer`` levels dropped), how many wrappers are nested
            outside this one, and the parameter names ``target_parameters`` allows there
            (which one it is, the model's shapes tell: see ``ExpertsLowRankKind.place``).
        """
        if not self.target_parameters:
            return None
        depth = 0
        while module.endswith(".base_layer"):
            module, depth = module[: -len(".base_layer")], depth + 1
        name = module.removeprefix("base_model.model.")
        if depth == 0 and self._targets_module(name):
            return None
        # PEFT adapts parameter p of this module when "<name>.<p>" is an entry or ends with
        # "." + an entry
        names = tuple(sorted({
            t.rpartition(".")[2] for t in self.target_parameters
            if f"{name}.{t.rpartition('.')[2]}" == t
            or f"{name}.{t.rpartition('.')[2]}".endswith(f".{t}")}))
        return (module, depth, names) if names else None

    def token_rows(self, module: str) -> tuple[int, ...] | None:
        """The trained rows of ``module``'s ``trainable_tokens_delta``, or None."""
        indices = self.trainable_token_indices
        if indices is None or isinstance(indices, tuple):
            return indices
        name = module.removeprefix("base_model.model.")
        return next((rows for t, rows in indices.items()
                     if name == t or name.endswith(f".{t}")), None)

    def _targets_module(self, name: str) -> bool:
        """PEFT's ``target_modules`` test of module ``name`` (without the PeftModel prefix);
        ``"all-linear"`` (which PEFT expands to names before saving) takes every module.
        """
        if self.target_modules == "all-linear":
            return True
        if isinstance(self.target_modules, str):
            return compile_key(self.target_modules, whole=True).matches(name)
        return any(name == t or name.endswith(f".{t}") for t in self.target_modules or ())

    def _pattern(self, table: dict[str, Any], module: str) -> Any:
        name = module.removeprefix("base_model.model.")
        for pat, value in table.items():
            if compile_key(pat).matches(name):
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


def _table(d: dict[str, Any], field: str, where: str) -> dict[Any, Any]:
    value = d.get(field) or {}
    if not isinstance(value, dict):
        raise AdapterFormatError(
            f"{where}: {field} is a {type(value).__name__}; it must map module patterns to "
            f'values (e.g. {{"down_blocks.0": 4}}). Fix the config file.'
        )
    return value


def _names(value: Any, field: str, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AdapterFormatError(
            f"{where}: {field} is {value!r}; it must be a list of names (e.g. "
            '["mlp.experts.down_proj"]). Fix the config file.')
    return list(value)


def _token_indices(value: Any, where: str
                   ) -> dict[str, tuple[int, ...]] | tuple[int, ...] | None:
    """``trainable_token_indices``: a list of token ids, or module name -> such a list."""
    if value is None:
        return None

    def rows(v: Any, field: str) -> tuple[int, ...]:
        ok = isinstance(v, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
        if not ok or len(set(v)) != len(v):
            raise AdapterFormatError(
                f"{where}: {field} is {v!r}; it must list distinct token ids (whole numbers "
                ">= 0, e.g. [32000, 32001]). Fix the config file.")
        return tuple(v)

    if isinstance(value, dict):
        return {str(k): rows(v, f"trainable_token_indices[{k!r}]") for k, v in value.items()}
    return rows(value, "trainable_token_indices")


def _targets(value: Any, where: str) -> tuple[str, ...] | str | None:
    """``target_modules``: None, one regular expression, or a list of module names."""
    if value is None or isinstance(value, str):
        return value
    return tuple(_names(value, "target_modules", where))


def _rank(value: Any, field: str, where: str) -> int:
    """A rank from a config: a whole number >= 1 (``8`` or ``8.0``; not ``True``, ``1e999``)."""
    ok = isinstance(value, (int, float, str)) and not isinstance(value, bool)
    try:
        r = float(value) if ok else math.nan
    except (ValueError, OverflowError):
        r = math.nan
    if not (math.isfinite(r) and r == int(r) and r >= 1):
        raise AdapterFormatError(
            f"{where}: {field} is {value!r}; a rank must be a whole number >= 1 (e.g. 8). "
            "Fix the config file."
        )
    return int(r)


def _alpha(value: Any, field: str, where: str) -> float:
    """An alpha from a config: a finite number within float32's range."""
    ok = isinstance(value, (int, float, str)) and not isinstance(value, bool)
    try:
        a = float(value) if ok else math.nan
    except (ValueError, OverflowError):
        a = math.nan
    if not (math.isfinite(a) and abs(a) <= _FLOAT32_MAX):
        raise AdapterFormatError(
            f"{where}: {field} is {value!r}; alpha must be a finite number within float32's "
            f"range (|alpha| <= {_FLOAT32_MAX:.4g}), usually the rank or twice it. Fix the "
            "config file."
        )
    return a


_FLOAT32_MAX = 3.4028234663852886e38
