"""The model side of key resolution: its module paths, component roots and kohya spellings.

kohya writes a module path with every ``.`` turned into ``_``, which cannot be undone by guessing
(``to_q`` and ``img_attn`` contain underscores of their own). :class:`ModelNames` instead builds
the map forward: every module path of the model, spelled the kohya way from each root it may be
relative to, pointing back at the path.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch

__all__ = ["ADAPTER_PREFIXES", "ModelNames", "fused_modules", "transposed_modules"]

# Prefixes adapters put before module paths, and that models may have as component roots.
ADAPTER_PREFIXES = (
    "base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.",
    "model.", "text_encoder_3.", "text_encoder_2.", "text_encoder.", "text_encoders.",
)
_TE = re.compile(r"^text_encoder(_(\d))?\.")
_BASE_LAYER = ".base_layer"


class ModelNames:
    """Parameter names and shapes of a model, indexed for resolution.

    Args:
        params: parameter name -> shape (``dict((n, p.shape) for n, p in
            model.named_parameters())``); a model's tensors may be on the ``meta`` device.
        fused: paths of modules that run fused projections beside their split ones
            (:func:`fused_modules`); adapter updates of their split layers go to the rows of
            the fused layer instead.
        transposed: the module paths whose ``is_transposed`` is true (transformers' MoE
            experts stored (experts, in, out)); None when only shapes are known (a
            checkpoint), which also leaves ``params`` out of registration order.
    """

    def __init__(self, params: Mapping[str, torch.Size | tuple[int, ...]],
                 fused: Iterable[str] = (), transposed: Iterable[str] | None = None):
        self.shapes = {n: torch.Size(s) for n, s in params.items()}
        self.fused = frozenset(fused)
        self.transposed = None if transposed is None else frozenset(transposed)
        self._order: dict[str, int] | None = None
        # module path -> its parameter names (relative); a bare parameter is its own module.
        self.modules: dict[str, set[str]] = defaultdict(set)
        # PEFT's wrapped layers (after diffusers' load_lora_weights, or in a PeftModel) keep
        # the original weight at ``<layer>.base_layer.weight``: the layer's own name reaches it.
        self.base_layers: dict[tuple[str, str], str] = {}
        for name in self.shapes:
            module, _, leaf = name.rpartition(".")
            self.modules[module].add(leaf)
            if module.endswith(_BASE_LAYER):
                wrapper = module[:-len(_BASE_LAYER)]
                self.modules[wrapper].add(leaf)
                self.base_layers[(wrapper, leaf)] = name
        # A root is a model prefix of one or two dotted components ("transformer.",
        # "model.diffusion_model."): collect those of every module once, then look them up.
        heads = set()
        for m in self.modules:
            parts = m.split(".", 2)  # "a.b.c..." starts with "a." and "a.b."; "a.b" only "a."
            if len(parts) > 1:
                heads.add(parts[0] + ".")
            if len(parts) > 2:
                heads.add(f"{parts[0]}.{parts[1]}.")
        self.roots = [""] + [p for p in ADAPTER_PREFIXES if p in heads]
        self._kohya: dict[str, list[tuple[str, str]]] | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelNames:
        """Index ``model.named_parameters()`` (tied parameters are listed once) and the
        modules that run fused projections (:func:`fused_modules`).
        """
        return cls({n: p.shape for n, p in model.named_parameters()}, fused_modules(model),
                   transposed_modules(model))

    def params_of(self, module: str) -> dict[str, torch.Size]:
        """``module``'s own parameters (leaf -> shape), in the model's order."""
        if self._order is None:
            self._order = {n: i for i, n in enumerate(self.shapes)}
        full = {leaf: self.param(module, leaf) for leaf in self.modules.get(module, ())}
        order = self._order
        return {leaf: self.shapes[n] for leaf, n in
                sorted(((k, v) for k, v in full.items() if v is not None),
                       key=lambda kv: order[kv[1]])}

    def param(self, module: str, leaf: str) -> str | None:
        """The full name of parameter ``leaf`` of ``module``, or of the bare parameter
        ``module`` itself when ``leaf`` is ``"weight"``.
        """
        if (module, leaf) in self.base_layers:
            return self.base_layers[(module, leaf)]
        if leaf in self.modules.get(module, ()):
            return f"{module}.{leaf}" if module else leaf
        if leaf == "weight" and module in self.shapes:
            return module
        return None

    def has_module(self, path: str) -> bool:
        """Whether ``path`` owns parameters or is a parameter."""
        return path in self.modules or path in self.shapes

    def kohya_candidates(self, underscored: str) -> list[tuple[str, str]]:
        """``(root, module_path)`` pairs whose path below ``root``, spelled with ``_``, is
        ``underscored``.
        """
        if self._kohya is None:
            table: dict[str, list[tuple[str, str]]] = defaultdict(list)
            for path in set(self.modules) | set(self.shapes):
                for root in self.roots:
                    if path.startswith(root) and path != root.rstrip("."):
                        table[path[len(root):].replace(".", "_")].append((root, path))
            self._kohya = table
        return list(dict.fromkeys(self._kohya.get(underscored, ())))

    @staticmethod
    def text_encoder_index(root: str) -> int | None:
        """1 for ``text_encoder.``, 2 for ``text_encoder_2.``, ...; None for other roots."""
        m = _TE.match(root)
        if m is None:
            return None
        return int(m.group(2)) if m.group(2) else 1

    @staticmethod
    def text_encoder_root(index: int) -> str:
        """``text_encoder.`` for 1, ``text_encoder_2.`` for 2, ..."""
        return "text_encoder." if index == 1 else f"text_encoder_{index}."


def transposed_modules(model: torch.nn.Module) -> frozenset[str]:
    """Paths of the modules of ``model`` whose stacked expert tensors are stored
    (experts, in, out): transformers marks them ``is_transposed`` (GPT-OSS); the others are
    (experts, out, in).
    """
    return frozenset(n for n, m in model.named_modules()
                     if getattr(m, "is_transposed", False) is True)


def fused_modules(model: torch.nn.Module) -> frozenset[str]:
    """Paths of the modules of ``model`` whose forward runs fused projections.

    diffusers' ``fuse_qkv_projections()`` gives each attention module a ``to_qkv`` (and
    ``to_added_qkv``, or ``to_kv`` for cross-attention) built from ``to_q``/``to_k``/``to_v``,
    keeps those split layers as they are, and sets ``fused_projections = True``; from then on
    the forward reads only the fused layers.
    """
    # Fusing sets the flag on the instance; reading __dict__ avoids nn.Module.__getattr__'s
    # failed lookup (an exception) on each of a large model's thousands of other modules.
    return frozenset(name for name, m in model.named_modules()
                     if m.__dict__.get("fused_projections") is True)
