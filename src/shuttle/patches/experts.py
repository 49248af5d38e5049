"""Per-expert low-rank patches: PEFT's ``ParamWrapper`` (``target_parameters``) on a stacked MoE
tensor, one LoRA per expert in one pair of factors.

Shapes (E experts, r = rank per expert):
    down  (E * r, in)    rows of expert e: ``down[e * r:(e + 1) * r]``
    up    (out, E * r)   columns of expert e: ``up[:, e::E][:, :r]``, i.e. ``up`` viewed
                         (out, r, E) holds expert e at ``[:, :, e]``
    delta (E, out, in)   ``delta[e] = scale * up_e @ down_e``; stored ``(E, in, out)`` by a
                         module whose ``is_transposed`` is true (GPT-OSS), transposed per expert.

A 2-D parameter is the case E = 1: ``scale * up @ down`` of shape (out, in).

The file names the module, not the parameter (nested wrappers add a ``.base_layer`` each), so
the patch is built with every parameter the config allows there (:attr:`ExpertsLowRank.choices`)
and placed on one when the model's shapes are known (:meth:`ExpertsLowRankKind.place`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from shuttle.errors import ShapeMismatchError, UnsupportedFormatError
from shuttle.patches.kind import PatchKind, register_kind
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["NOT_WRITTEN", "Choice", "ExpertsLowRank", "ExpertsLowRankKind"]

# Why no writer spells it: kohya and comfy have no per-expert key, and PEFT's needs the
# adapter_config.json the file came with.
NOT_WRITTEN = (
    "a PEFT target_parameters update (per-expert LoRA on stacked MoE experts) has no kohya, "
    "comfy or stand-alone PEFT spelling. Keep the PEFT adapter directory it came from (its "
    "adapter_config.json says which parameters it adapts), or merge it into the model "
    "(shuttle.merge_lora, shuttle.merge_files).")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One parameter a ``ParamWrapper``'s factors may adapt, with the config's numbers for it.

    Attributes:
        param: the parameter's name in its module (``"down_proj"``).
        rank: the rank per expert (``r``, or ``rank_pattern``'s for ``<module>.<param>``).
        scale: ``alpha / rank`` (``/ sqrt(rank)`` with rsLoRA) for that parameter.
        alpha: the alpha the scale came from.
    """

    param: str
    rank: int
    scale: float
    alpha: float


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertsLowRank(Patch):
    """``scale * up_e @ down_e`` for every expert e of a stacked (E, out, in) parameter.

    Attributes:
        up: (out, E * r) factor (PEFT's ``lora_B``).
        down: (E * r, in) factor (PEFT's ``lora_A``).
        choices: the parameters it may adapt; one once placed (then ``param`` is its name).
        depth: how many wrappers PEFT nested outside this one on the module (0: outermost).
        transposed: the parameter is stored (E, in, out) (the module's ``is_transposed``).
    """

    up: Tensorish
    down: Tensorish
    choices: tuple[Choice, ...] = ()
    depth: int = 0
    transposed: bool = False
    tensor_fields = ("up", "down")

    @property
    def placed(self) -> bool:
        """Whether the parameter is chosen (one choice left)."""
        return len(self.choices) == 1

    def _choice(self) -> Choice:
        if not self.placed:
            raise ShapeMismatchError(
                f"experts_lora patch (PEFT target_parameters) is not placed yet: it may adapt "
                f"any of {[c.param for c in self.choices]}; resolve it against the model "
                "(shuttle.resolve, or any merge onto the model) first.")
        return self.choices[0]

    @property
    def rank(self) -> int | None:
        return self.choices[0].rank if self.placed else None

    @property
    def alpha(self) -> float | None:
        return self.choices[0].alpha if self.placed else None

    @property
    def scale(self) -> float:
        """The scale (alpha / rank) of the chosen parameter."""
        return self._choice().scale

    @property
    def experts(self) -> int:
        """E: the rows of ``down`` over the rank."""
        return self.down.shape[0] // self._choice().rank

    def fits(self, choice: Choice, shape: tuple[int, ...], transposed: bool) -> bool:
        """Whether the factors, read as ``choice``'s, update a parameter of ``shape`` stored
        (E, in, out) when ``transposed``.
        """
        rows, cols = self.down.shape[0], self.up.shape[1]
        out, inp = self.up.shape[0], self.down.shape[1]
        if len(self.up.shape) != 2 or len(self.down.shape) != 2 or rows != cols \
                or rows % choice.rank:
            return False
        if len(shape) == 2:
            return rows == choice.rank and not transposed and tuple(shape) == (out, inp)
        if len(shape) != 3 or shape[0] * choice.rank != rows:
            return False
        return tuple(shape[1:]) == ((inp, out) if transposed else (out, inp))

    def check(self, shape: torch.Size | tuple[int, ...], name: str) -> None:
        if not self.fits(self._choice(), tuple(shape), self.transposed):
            layout = "(experts, in, out)" if self.transposed else "(experts, out, in)"
            raise ShapeMismatchError(
                f"experts_lora patch for {name!r} has tensors {self.shapes()} (rank "
                f"{self.rank} per expert), which do not update a {layout} parameter of shape "
                f"{tuple(shape)}. The adapter was made for a different model; check that you "
                "load it into the model it was trained for.")

    def delta(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        c = self._choice()
        e, out, inp = self.down.shape[0] // c.rank, self.up.shape[0], self.down.shape[1]
        down = materialize(self.down).float().reshape(e, c.rank, inp)
        up = materialize(self.up).float().reshape(out, c.rank, e).permute(2, 0, 1)
        d = torch.bmm(up, down)  # (E, out, in)
        if self.transposed:
            d = d.transpose(1, 2)
        return d.mul_(c.scale).reshape(shape)


@register_kind
class ExpertsLowRankKind(PatchKind):
    """PEFT's ``ParamWrapper`` factors: built by the PEFT reader from a config with
    ``target_parameters`` (no roles of its own), placed on a parameter by the model's shapes,
    merged through the weight (no low-rank form beside a layer: the module is no Linear).
    """

    name = "experts_lora"
    patch = ExpertsLowRank

    def spell(self, module: str, patch: Patch, to: str,  # noqa: D102
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise UnsupportedFormatError(f"module {module!r}: {NOT_WRITTEN}")

    def place(self, patch: Patch, params: Mapping[str, tuple[int, ...]],  # noqa: D102
              transposed: bool | None, ordered: bool) -> Patch | str:
        # Between parameters the factors fit alike, PEFT's nesting decides: it wraps the
        # module's matching parameters in registration order, the first one innermost.
        assert isinstance(patch, ExpertsLowRank)
        layouts = (False, True) if transposed is None else (transposed,)
        fits = [(c, t) for c in patch.choices if c.param in params
                for t in layouts if patch.fits(c, tuple(params[c.param]), t)]
        if len({c.param for c, _ in fits}) > 1 and ordered:
            matched = [p for p in params if p in {c.param for c in patch.choices}]
            if patch.depth < len(matched):
                nested = matched[len(matched) - 1 - patch.depth]
                fits = [(c, t) for c, t in fits if c.param == nested]
        if len(fits) == 1:
            c, t = fits[0]
            return dataclasses.replace(patch, param=c.param, choices=(c,), transposed=t)
        names = [c.param for c in patch.choices]
        shapes = {p: tuple(params[p]) for p in names if p in params}
        if not fits:
            return (f"its factors {patch.shapes()} fit none of the parameters PEFT's "
                    f"target_parameters allows here ({shapes or names})")
        if len({c.param for c, _ in fits}) > 1:
            return (f"its factors fit several parameters ({sorted({c.param for c, _ in fits})}),"
                    " which only the model's registration order tells apart: merge onto the "
                    "model itself (not a checkpoint's shapes)")
        return (f"its factors fit {fits[0][0].param!r} stored either way round (a square "
                "(experts, n, n) tensor) and nothing says which: merge onto the model itself, "
                "whose experts module's is_transposed tells it")
