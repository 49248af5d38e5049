"""Group an adapter's tensors by module and build each module's patches.

Scale rules (the same in every format; see docs/formats.md):
    * a module's ``alpha`` tensor gives ``scale = alpha / rank`` (rank = ``down.shape[0]``), with
      ``alpha == 0`` meaning ``alpha = rank``;
    * without one, a PEFT config gives ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA, per-module
      patterns applied): the config of the module's component where the file has one per
      component (diffusers' pipeline metadata, patterns matched below ``<component>.``), else
      the adapter's one config;
    * without either, the scale is 1.

A PEFT config with ``target_parameters`` turns the factors of each ``ParamWrapper`` into an
:class:`~shuttle.patches.ExpertsLowRank` on the module it wraps, to be placed on one of its
parameters by shape (:meth:`~shuttle.patches.experts.ExpertsLowRankKind.place`).

Embedding rows PEFT trained (``trainable_token_indices``, saved as
``<module>.token_adapter.trainable_tokens_delta``) become a
:class:`~shuttle.patches.ReplaceRows` of the rows the config names.

Tensors a PEFT config says are saved whole (``modules_to_save`` copies, ``bias="all"``
biases) become :class:`~shuttle.patches.Replace` patches, ahead of the module's other patches
(PEFT adds a ``lora_B.bias`` to the trained bias it loaded).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

from shuttle.errors import AdapterFormatError, UnknownKeyError, UnsupportedFormatError
from shuttle.formats.peft import PeftConfig
from shuttle.formats.registry import AdapterFormat
from shuttle.formats.roles import split_key, unsupported_kind
from shuttle.patches import (
    PATCH_KINDS,
    ExpertsLowRank,
    Found,
    LowRank,
    Patch,
    Replace,
    ReplaceRows,
    materialize,
)
from shuttle.patches.experts import Choice
from shuttle.patches.kind import STAGES
from shuttle.patches.patch import Tensorish

__all__ = ["assemble"]

_MAX_LISTED = 8


def assemble(
    table: Mapping[str, Tensorish],
    fmt: AdapterFormat,
    config: PeftConfig | None,
    *,
    components: Mapping[str, PeftConfig] | None = None,
    strict: bool = True,
    source: str = "adapter",
) -> tuple[dict[str, list[Patch]], dict[str, str]]:
    """Build ``{module_key: [patches]}`` from an adapter's tensors.

    Args:
        table: tensor name -> tensor or lazy reference.
        fmt: the detected format (its ``rename`` is applied to every key first).
        config: the PEFT config, if the adapter has one.
        components: per-component PEFT configs (diffusers pipeline files): component name ->
            the config of the modules under ``<component>.``, in place of ``config``.
        strict: raise on keys of no known kind; otherwise report them in the second result.
        source: how to name the adapter in messages.

    Returns:
        ``(modules, skipped)``: the patches of each module, and keys that were not used with
        the reason (harmless ones such as an ``alpha`` without factors).

    Raises:
        UnsupportedFormatError: keys of a recognized but unimplemented format (OFT, GLoRA, ...).
        UnknownKeyError: keys of no known kind (with ``strict``).
        AdapterFormatError: a module's tensors do not form a patch (an up without a down, ...).
    """
    roles: dict[str, dict[str, tuple[str, Tensorish]]] = defaultdict(dict)
    whole: dict[str, dict[str, tuple[str, Tensorish]]] = defaultdict(dict)  # module -> param
    unknown: list[str] = []
    skipped: dict[str, str] = {}
    on_input_modules = {k[: -len(".on_input")] for k in table if k.endswith(".on_input")}
    names = {key: fmt.rename(key) if fmt.rename else key for key in table}
    plain = set(names.values())
    rows: dict[str, list[Patch]] = defaultdict(list)  # PEFT's trainable token rows
    for key, t in table.items():
        name = names[key]
        if name.endswith(_TOKEN_ROWS):
            module = name[: -len(_TOKEN_ROWS)]
            rows[module].append(_token_rows(key, module, t, config, components or {}, source))
            continue
        split = split_key(name)
        if split is None and name.endswith(".weight") and name[:-7] in on_input_modules:
            split = (name[:-7], "ia3_weight")
        saved = _saved_whole(name, split, config, components or {})
        if saved is not None:
            module, param, wrapper = saved
            if wrapper == "original_module":
                skipped[key] = ("PEFT's untouched original of a modules_to_save module "
                                "(bias='all' saves it too); the saved copy replaces it")
                continue
            if wrapper == "modules_to_save" and f"{module}.{param}" in plain:
                skipped[key] = (f"the same saved copy as {module}.{param} (bias='all' "
                                "writes it twice)")
                continue
            if param in whole[module]:
                raise AdapterFormatError(
                    f"{source}: keys {whole[module][param][0]!r} and {key!r} both hold the saved "
                    f"{param!r} of module {module!r}; remove one of them from the file."
                )
            whole[module][param] = (key, t)
            continue
        if split is None:
            kind = unsupported_kind(name)
            if kind is not None:
                raise UnsupportedFormatError(
                    f"{source}: key {key!r} belongs to a {kind} adapter, which shuttle does not "
                    "implement yet. Supported: LoRA/LoCon/Tucker, DoRA, LoHa, LoKr, full/norm "
                    "diffs, set_weight, (IA)3."
                )
            if key.startswith("bundle_emb.") or key.startswith("emb_params"):
                skipped[key] = "embedding bundle (textual inversion), not a weight update"
                continue
            unknown.append(key)
            continue
        module, role = split
        if role in roles[module]:
            raise AdapterFormatError(
                f"{source}: keys {roles[module][role][0]!r} and {key!r} both give the {role!r} "
                f"tensor of module {module!r}; remove one of them from the file."
            )
        roles[module][role] = (key, t)
    if unknown:
        listed = ", ".join(repr(k) for k in unknown[:_MAX_LISTED])
        more = f" and {len(unknown) - _MAX_LISTED} more" if len(unknown) > _MAX_LISTED else ""
        peft = [k for k in unknown if k.startswith("base_model.model.")]
        if strict:
            raise UnknownKeyError(
                f"{source}: {len(unknown)} key(s) of no known adapter kind: {listed}{more}. "
                + (_PEFT_WHOLE if peft else
                   "If this is a full model checkpoint, it is not an adapter; ")
                + "to skip these keys, pass strict=False to load_lora."
            )
        for k in unknown:
            skipped[k] = ("looks like a PEFT modules_to_save copy or trained bias, but no "
                          "adapter_config.json names it (strict=False)" if k in peft else
                          "key of no known adapter kind (strict=False)")
    modules: dict[str, list[Patch]] = {}
    for module in {**whole, **roles, **rows}:
        cfg, name = _config_of(module, config, components or {})
        patches = _build_module(module, roles[module], cfg, name, fmt, source) \
            if module in roles else []
        if not patches and module in roles:
            for key, _ in roles[module].values():
                skipped[key] = "alpha without factors: nothing to apply"
        wrapped = cfg.wrapped_parameter(name) if cfg is not None and patches else None
        if wrapped is not None:  # a ParamWrapper's factors: kept under the module it wraps
            adapted = module[: len(module) - len(name)] + wrapped[0]
            modules.setdefault(adapted, []).extend(
                _param_wrapper(p, wrapped, cfg, source) for p in patches)
            patches = []
        patches = [Replace(p, value=t) for p, (_, t) in whole.get(module, {}).items()] \
            + rows.get(module, []) + patches
        if patches:
            modules.setdefault(module, []).extend(patches)
    return modules, skipped


_TOKEN_ROWS = ".token_adapter.trainable_tokens_delta"


def _token_rows(key: str, module: str, t: Tensorish, config: PeftConfig | None,
                components: Mapping[str, PeftConfig], source: str) -> Patch:
    """PEFT's trained embedding rows (``trainable_token_indices``) as a ``ReplaceRows``."""
    cfg, inner = _config_of(module, config, components)
    indices = cfg.token_rows(inner) if cfg is not None else None
    if indices is None:
        raise AdapterFormatError(
            f"{source}: {key!r} holds embedding rows PEFT trained (trainable_token_indices), "
            "but no adapter_config.json says which token ids they are: load the adapter "
            "directory with its adapter_config.json, or pass load_lora(file, config={...}) "
            "with its trainable_token_indices.")
    if not t.dtype.is_floating_point:
        raise AdapterFormatError(
            f"{source}: {key!r} is {str(t.dtype).removeprefix('torch.')}; trained embedding "
            "rows must be floating point. The file is corrupt; export it again.")
    if len(t.shape) != 2 or t.shape[0] != len(indices):
        raise AdapterFormatError(
            f"{source}: {key!r} has shape {tuple(t.shape)}, but the config trains "
            f"{len(indices)} token(s) there (trainable_token_indices): one row each. The "
            "file and its adapter_config.json do not belong together; export them again.")
    return ReplaceRows("weight", indices=indices, value=t)


def _param_wrapper(patch: Patch, wrapped: tuple[str, int, tuple[str, ...]], cfg: PeftConfig,
                   source: str) -> Patch:
    """A ``ParamWrapper``'s LoRA as an :class:`ExpertsLowRank` that may adapt each parameter
    the config allows on its module, with that parameter's rank and scale (PEFT matches
    ``rank_pattern``/``alpha_pattern`` against ``<module>.<param>``).
    """
    module, depth, names = wrapped
    if not isinstance(patch, LowRank) or patch.mid is not None or patch.transposed:
        raise AdapterFormatError(
            f"{source}: module {module!r} is adapted through PEFT's target_parameters (the "
            f"config's {list(cfg.target_parameters)}), whose wrapper saves lora_A/lora_B "
            f"only, but the file has a {patch.kind} patch there. The file and its "
            "adapter_config.json do not belong together; export the adapter again.")
    inner = module.removeprefix("base_model.model.")
    choices = []
    for param in names:
        rank = cfg.rank_for(f"{inner}.{param}")
        choices.append(Choice(param, rank, cfg.scale_for(f"{inner}.{param}", rank),
                              cfg.alpha_for(f"{inner}.{param}")))
    return ExpertsLowRank("|".join(names), up=patch.up, down=patch.down, choices=tuple(choices),
                          depth=depth)


_PEFT_WHOLE = (
    "Plain 'base_model.model.<module>.<param>' keys are how PEFT saves tensors it trained in "
    "full: the modules listed under modules_to_save in adapter_config.json (a head, an "
    "embedding) and, with bias='all' or 'lora_only', biases. shuttle applies them as "
    "whole-parameter replacements when the config says which they are: load the adapter "
    "directory with its adapter_config.json, or pass that config as "
    "load_lora(file, config={...}) (with its modules_to_save / bias); "
)


def _saved_whole(
    name: str, split: tuple[str, str] | None, config: PeftConfig | None,
    components: Mapping[str, PeftConfig],
) -> tuple[str, str, str | None] | None:
    """``(module, param, wrapper)`` when key ``name`` holds a tensor the PEFT config saves
    whole (:meth:`PeftConfig.saved_whole`).

    Factor keys keep their meaning; a plain key, or one whose leaf merely looks like a role
    (a module's own ``alpha`` or ``scale`` parameter), is a saved tensor if the config says so.
    """
    if split is not None and split[1] not in ("alpha", "norm_scale"):
        return None
    module, _, param = name.rpartition(".")
    cfg, inner = _config_of(module, config, components)
    if not module or cfg is None:
        return None
    found = cfg.saved_whole(inner, param)
    if found is None:
        return None
    return module[: len(module) - len(inner)] + found[0], param, found[1]


def _config_of(
    module: str, config: PeftConfig | None, components: Mapping[str, PeftConfig]
) -> tuple[PeftConfig | None, str]:
    """The config that scales ``module``, and the name its patterns are matched against: a
    component's config sees the names inside that component (as PEFT did when it trained it).
    """
    component, dot, rest = module.partition(".")
    if dot and component in components:
        return components[component], rest
    return config, module


_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def _scalar(key: str, t: Tensorish, source: str) -> float:
    v = materialize(t)
    if v.numel() != 1:
        raise AdapterFormatError(f"{source}: {key!r} should hold one number, has shape "
                                 f"{tuple(v.shape)}")
    x = float(v.reshape(()).double().item())  # float64: a writer's alpha keeps its scale
    if not math.isfinite(x):
        raise AdapterFormatError(f"{source}: {key!r} is {x}; alpha must be finite. The file is "
                                 "corrupt; export it again.")
    return x


def _build_module(
    module: str,
    r: dict[str, tuple[str, Tensorish]],
    config: PeftConfig | None,
    config_name: str,
    fmt: AdapterFormat,
    source: str,
) -> list[Patch]:
    """The module's patches: each registered kind with a role here builds its own
    (:meth:`PatchKind.build`), the "main" kinds first, then a "wrap" around it, then "extra".
    """
    kinds = [k for k in PATCH_KINDS.values() if any(role in r for role in k.roles)]
    factors = {role for k in kinds for role in k.factor_roles}
    integers = {"alpha"}.union(*(k.integer_roles for k in kinds))
    for role, (key, t) in r.items():
        # An integer factor or diff would be merged as numbers (a weight moved by ~1e8); only an
        # alpha, a set_weight (an integer buffer's value) or an (IA)3 on_input flag may be.
        if role not in integers and not t.dtype.is_floating_point:
            raise AdapterFormatError(
                f"{source}: {key!r} is {str(t.dtype).removeprefix('torch.')}; adapter factors "
                "and diffs must be floating point. The file is corrupt or was converted wrongly; "
                "export it again in float32, float16 or bfloat16."
            )
        if role in factors and len(t.shape) < 2:
            raise AdapterFormatError(
                f"{source}: {key!r} has shape {tuple(t.shape)}; adapter factors are matrices "
                "or conv kernels. The file is corrupt; export it again."
            )
        if role in factors and 0 in t.shape:
            raise AdapterFormatError(
                f"{source}: {key!r} has shape {tuple(t.shape)}: an empty factor (rank 0) gives "
                f"no update. The file is corrupt; export it again, or remove the keys of module "
                f"{module!r} from it."
            )
    alpha = _scalar(*r["alpha"], source) if "alpha" in r else None

    def scale(rank: int | None) -> float:
        s = _scale(rank)
        if not (math.isfinite(s) and abs(s) <= _FLOAT32_MAX):
            given = f"alpha {alpha!r}" if alpha is not None else "the config's alpha"
            raise AdapterFormatError(
                f"{source}: module {module!r}: {given} over rank {rank} gives the scale {s:.4g}, "
                f"beyond float32's range (|scale| <= {_FLOAT32_MAX:.4g}). The alpha is corrupt; "
                "export the adapter again (alpha is usually the rank or twice it)."
            )
        return s

    def _scale(rank: int | None) -> float:
        if rank is None:  # LoKr with both factors full: LyCORIS forces scale 1, PEFT does not
            if config is not None and alpha is None:
                return config.alpha_for(config_name) / config.rank_for(config_name)
            return 1.0
        if alpha is not None:
            return (alpha if alpha != 0 else rank) / rank
        if config is not None:
            return config.scale_for(config_name, rank)
        return 1.0

    found = Found(module, r, scale, alpha=alpha, transposed=bool(config and config.fan_in_fan_out),
                  fmt=fmt, source=source)
    extra: list[Patch] = []
    for stage in STAGES:
        for kind in kinds:
            if kind.stage != stage:
                continue
            built = kind.build(found)
            if stage == "extra":
                extra += built
                continue
            assert len(built) <= 1 or stage == "main", f"{kind.name} wraps in {len(built)}"
            for p in built:
                found.main = _one(found.main, p, module, source) if stage == "main" else p
    patches = ([found.main] if found.main is not None else []) + extra
    weight_patches = [p for p in patches if p.param == "weight"]
    if len(weight_patches) > 1 and any(PATCH_KINDS[p.kind].replaces for p in weight_patches):
        raise AdapterFormatError(
            f"{source}: module {module!r} both replaces its weight (set_weight) and updates it; "
            "the update would be lost. Remove one of them from the file."
        )
    return patches


def _one(prev: Patch | None, new: Patch, module: str, source: str) -> Patch:
    if prev is not None:
        raise AdapterFormatError(
            f"{source}: module {module!r} has factors of two kinds ({prev.kind} and {new.kind}); "
            "an adapter gives one update per weight. The file is malformed."
        )
    return new
