"""A small model of every layer kind the adapter libraries wrap, and shuttle's two ways of running
an adapter on it, for the library oracle tests (test_oracle_peft/lycoris/diffusers.py).

Each layer gets its own input, so an output compared is one layer's forward (float32 throughout;
the tolerances are a few float32 ulps of the output's size).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import shuttle

STRENGTHS = [1.0, 0.5]
MODES = ["merge", "dynamic"]


class Layers(nn.Module):
    """Linear, Conv1d, Conv2d (one with in == out channels), Embedding and LayerNorm side by side.

    Output sizes are powers of two so that every LyCORIS algorithm (BOFT's butterfly factors
    included) can wrap them.
    """

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 32)
        self.c1 = nn.Conv1d(8, 16, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.sq = nn.Conv2d(16, 16, 3)  # in == out channels: the axes of a conv magnitude
        self.emb = nn.Embedding(10, 16)
        self.norm = nn.LayerNorm(32)

    def forward(self, x, seq, img, sq, ids, h) -> dict[str, torch.Tensor]:
        return {"lin": self.lin(x), "c1": self.c1(seq), "c2": self.c2(img), "sq": self.sq(sq),
                "emb": self.emb(ids), "norm": self.norm(h)}


def make_base(seed: int = 0) -> Layers:
    torch.manual_seed(seed)
    model = Layers()
    with torch.no_grad():  # a norm layer that is not the identity
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.normal_()
    return model


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 64, generator=g), torch.randn(2, 8, 7, generator=g),
            torch.randn(2, 8, 5, 5, generator=g), torch.randn(1, 16, 4, 4, generator=g),
            torch.tensor([[0, 3, 9], [5, 5, 1]]), torch.randn(3, 32, generator=g))


def outputs(model: nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model(*inputs())


def shuttle_outputs(base: nn.Module, lora, strength: float, mode: str) -> dict[str, torch.Tensor]:
    """``lora`` at ``strength`` on a copy of ``base``: merged (``merge_lora``) or attached
    (``apply_lora(mode="dynamic")``, checked to leave the weights bit-identical on exit).
    """
    model = copy.deepcopy(base)
    if mode == "merge":
        report = shuttle.merge_lora(model, [(lora, strength)])
        assert report.unmatched == {}, report.unmatched
        return outputs(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with shuttle.apply_lora(model, [(lora, strength)], mode="dynamic"):
        got = outputs(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed after the dynamic adapter ended"
    return got


def assert_outputs_close(got: dict, expected: dict, base: dict, adapted: set[str]) -> None:
    """Every output close to the library's; the ``adapted`` layers' outputs moved off the base's
    (so a test cannot pass with an adapter that does nothing), the others unchanged.
    """
    assert got.keys() == expected.keys()
    for name, e in expected.items():
        atol = 1e-6 * max(1.0, e.abs().max().item())
        torch.testing.assert_close(got[name], e, rtol=1e-5, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
        moved = not torch.allclose(e, base[name], rtol=1e-4, atol=1e-4)
        assert moved == (name in adapted), f"{name}: the library's adapter moved it: {moved}"


def randomize(params, seed: int = 2) -> None:
    """Seeded random values for an adapter's parameters (``(name, param)`` pairs), as after
    training: factors that start at zero become non-zero; magnitudes (``*magnitude*``,
    ``dora_scale``) are their initial norms times a factor in [0.5, 1.5).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in params:
            if "magnitude" in name or "dora_scale" in name:
                p.mul_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
