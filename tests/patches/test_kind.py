"""A patch kind is one registered object: a new kind declared in one place (here, a rank-one
``u v^T`` kind) is read from a file, merged, run dynamically and written, with no other edit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.errors import ShapeMismatchError
from shuttle.formats.roles import role_suffixes, split_key
from shuttle.hooks import hooks_of
from shuttle.patches import (
    PATCH_KINDS,
    Found,
    LowRank,
    Patch,
    PatchKind,
    materialize,
    register_kind,
)
from shuttle.patches.kind import alpha_tensor


@dataclasses.dataclass(frozen=True, eq=False)
class Rank1(Patch):
    """``delta = scale * outer(u, v)``: u (out,), v (in,)."""

    u: torch.Tensor = None
    v: torch.Tensor = None
    scale: float = 1.0
    tensor_fields = ("u", "v")

    @property
    def rank(self) -> int:
        return 1

    def check(self, shape, name):
        if tuple(shape) != (self.u.shape[0], self.v.shape[0]):
            raise ShapeMismatchError(f"{name}: rank-1 {self.shapes()} against {tuple(shape)}")

    def delta(self, shape):
        u, v = materialize(self.u).float(), materialize(self.v).float()
        return torch.outer(u, v).mul_(self.scale).reshape(shape)


class Rank1Kind(PatchKind):
    name = "test-rank1"
    patch = Rank1
    roles = {"rank1_u": ("rank1_u",), "rank1_v": ("rank1_v",)}
    stage = "main"

    def build(self, found: Found) -> list[Patch]:
        found.need("rank1_u", "rank1_v")
        return [Rank1("weight", u=found.get("rank1_u"), v=found.get("rank1_v"),
                      scale=found.scale(1))]

    def spell(self, module, patch, to, tensors):
        return {f"{module}.rank1_u": tensors["u"], f"{module}.rank1_v": tensors["v"],
                f"{module}.alpha": alpha_tensor(patch)}

    def lowrank(self, patch):
        return LowRank("weight", up=materialize(patch.u)[:, None],
                       down=materialize(patch.v)[None, :], scale=patch.scale)


@pytest.fixture
def rank1():
    register_kind(Rank1Kind)
    try:
        yield Rank1Kind
    finally:
        PATCH_KINDS.pop(Rank1Kind.name, None)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 4)

    def forward(self, x):
        return self.proj(x)


def _net(seed=0):
    torch.manual_seed(seed)
    return _Net()


def _file(path, g):
    u, v = torch.randn(4, generator=g), torch.randn(6, generator=g)
    save_file({"proj.rank1_u": u, "proj.rank1_v": v, "proj.alpha": torch.tensor(0.5)},
              str(path))
    return u, v


def test_a_new_kind_is_read_merged_run_dynamically_and_written(rank1, tmp_path):
    g = torch.Generator().manual_seed(0)
    u, v = _file(tmp_path / "r1.safetensors", g)
    assert split_key("proj.rank1_u") == ("proj", "rank1_u")
    lora = shuttle.load_lora(tmp_path / "r1.safetensors")
    (p,) = lora.modules["proj"]
    assert isinstance(p, Rank1) and p.kind == "test-rank1" and p.scale == 0.5  # alpha / rank

    merged = _net()
    w = merged.proj.weight.detach().clone()
    shuttle.merge_lora(merged, [(lora, 0.8)])
    want = (w.double() + 0.8 * 0.5 * torch.outer(u.double(), v.double())).float()
    torch.testing.assert_close(merged.proj.weight.detach(), want)

    x = torch.randn(3, 6, generator=g)
    for quality in ("exact", "lossless"):
        model = _net()
        handle = shuttle.attach_lora(model, [(lora, 0.8)], quality=quality)
        (hook,) = hooks_of(model.proj)
        assert len(hook.slots) == 1 and not hook.dense  # its low-rank form, in the tiers
        with torch.no_grad():
            torch.testing.assert_close(model(x), merged(x))
        handle.detach()

    out = shuttle.save_lora(lora, tmp_path / "back.safetensors", to="comfy")
    (q,) = shuttle.load_lora(out).modules["proj"]
    assert isinstance(q, Rank1) and q.scale == p.scale
    assert torch.equal(materialize(q.u), u) and torch.equal(materialize(q.v), v)


def test_a_new_kinds_roles_leave_with_it(rank1):
    assert "rank1_u" in role_suffixes()
    PATCH_KINDS.pop(rank1.name)
    assert "rank1_u" not in role_suffixes() and split_key("proj.rank1_u") is None


def test_a_missing_role_of_a_new_kind_names_it(rank1, tmp_path):
    save_file({"proj.rank1_u": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(shuttle.errors.AdapterFormatError, match="lacks its rank1_v"):
        shuttle.load_lora(tmp_path / "a.safetensors")


def test_every_builtin_kind_is_registered_with_its_patch_class():
    from shuttle.patches import (
        IA3,
        OFT,
        Diff,
        DoRA,
        ExpertsLowRank,
        LoHa,
        LoKr,
        Replace,
        ReplaceRows,
        Set,
    )

    want = {"lora": LowRank, "loha": LoHa, "lokr": LoKr, "diff": Diff, "set": Set, "ia3": IA3,
            "dora": DoRA, "replace": Replace, "experts_lora": ExpertsLowRank,
            "replace_rows": ReplaceRows, "oft": OFT}
    assert {n: k.patch for n, k in PATCH_KINDS.items()} == want
    assert all(k.name == n and k.patch.kind == n for n, k in PATCH_KINDS.items())
    with pytest.raises(AssertionError, match="registered twice"):
        register_kind(type(PATCH_KINDS["lora"]))
