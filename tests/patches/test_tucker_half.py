"""A Tucker LoCon stored in float16 is applied with one rounding, in every apply path.

kohya/LyCORIS Tucker LoCon: ``lora_down`` (r, in, 1, 1), ``lora_mid`` (r, r, 3, 3), ``lora_up``
(out, r, 1, 1), here in float16, on a float32 Conv2d 3x3. The core folded into ``down`` must stay
float32: rounding the fold to float16 before the product is a second rounding, about 3e-4 of the
update off the float64 result, where the float32 fold is some 1e-7 off.

The reference is float64 math written here: ``W + k * s * einsum(mid, up, down)``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.patches import LowRank

R, IN, OUT, K = 8, 16, 12, 3
SCALE = 4.0 / R  # alpha 4
STRENGTH = 0.7
REL = 1e-6  # of the result's scale; the doubly rounded fold is ~3e-4 off


def factors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "down": (torch.randn(R, IN, 1, 1, generator=g) * 0.5).half(),
        "mid": (torch.randn(R, R, K, K, generator=g) * 0.5).half(),
        "up": (torch.randn(OUT, R, 1, 1, generator=g) * 0.5).half(),
    }


def delta64(f: dict[str, torch.Tensor]) -> torch.Tensor:
    up, down, mid = (f[k].double() for k in ("up", "down", "mid"))
    # (out, in, k, k): sum_ij up[o, i] mid[i, j, ...] down[j, n]
    return SCALE * torch.einsum("i j ..., o i, j n -> o n ...", mid, up.flatten(1),
                                down.flatten(1))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(IN, OUT, K, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def adapter(f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"lora_unet_conv.lora_down.weight": f["down"],
            "lora_unet_conv.lora_mid.weight": f["mid"],
            "lora_unet_conv.lora_up.weight": f["up"],
            "lora_unet_conv.alpha": torch.tensor(4.0)}


@pytest.fixture
def setup():
    torch.manual_seed(0)
    net = Net()
    f = factors()
    # the update is about as large as the weight, so its error shows in the result
    with torch.no_grad():
        net.conv.weight.mul_(delta64(f).abs().max().item() / net.conv.weight.abs().max())
    expected = net.conv.weight.double() + STRENGTH * delta64(f)
    return net, shuttle.load_lora(adapter(f)), f, expected


def test_delta_is_folded_in_float32():
    f = factors()
    p = LowRank("weight", up=f["up"], down=f["down"], mid=f["mid"], scale=SCALE)
    up, down = p.factors()
    assert down.dtype == torch.float32 and up.dtype == torch.float16
    d = p.delta((OUT, IN, K, K))
    assert d.dtype == torch.float32
    assert rel_err(d, delta64(f)) < REL


def test_merge(setup):
    net, lora, _, expected = setup
    shuttle.merge_lora(net, [(lora, STRENGTH)])
    assert rel_err(net.conv.weight, expected) < REL


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_forward(setup, mode):
    # dynamic: the conv runs down (1x1), mid (3x3), up (1x1) on the float32 input; no fold.
    net, lora, _, expected = setup
    x = torch.randn(2, IN, 6, 6)
    ref = nn.functional.conv2d(x.double(), expected, net.conv.bias.double(), padding=1)
    with shuttle.apply_lora(net, [(lora, STRENGTH)], mode=mode):
        y = net(x)
    assert rel_err(y, ref) < 2 * REL


def test_dynamic_dense_residual(setup):
    # A Tucker patch applied through the float32 weight residual (the path of every layer
    # whose own op does not run the factors) also folds in float32.
    net, _, f, expected = setup
    p = LowRank("weight", up=f["up"], down=f["down"], mid=f["mid"], scale=SCALE)
    w = net.conv.weight.detach().clone()
    assert rel_err(p.apply(w, STRENGTH), expected) < REL


def test_load_checkpoint(setup, tmp_path):
    net, lora, _, expected = setup
    save_file({k: v.contiguous() for k, v in net.state_dict().items()},
              str(tmp_path / "ck.safetensors"))
    fresh = Net()
    shuttle.load_checkpoint(fresh, tmp_path / "ck.safetensors", [(lora, STRENGTH)])
    assert rel_err(fresh.conv.weight, expected) < REL


def test_merge_files(setup, tmp_path):
    net, lora, _, expected = setup
    save_file({k: v.contiguous() for k, v in net.state_dict().items()},
              str(tmp_path / "ck.safetensors"))
    report = shuttle.merge_files(tmp_path / "ck.safetensors", [(lora, STRENGTH)],
                                 tmp_path / "out.safetensors")
    from safetensors.torch import load_file

    merged = load_file(str(report.files[0]))["conv.weight"]
    assert merged.dtype == torch.float32
    assert rel_err(merged, expected) < REL


def test_half_base_rounds_once(setup):
    # A float16 weight: the float32 sum is rounded once, to the nearest float16 of the
    # float64 result (up to float32 ties).
    net, lora, _, _ = setup
    half = copy.deepcopy(net).half()
    expected = half.conv.weight.double() + STRENGTH * delta64(factors())
    shuttle.merge_lora(half, [(lora, STRENGTH)])
    nearest = expected.half()
    mism = (half.conv.weight != nearest).float().mean().item()
    assert mism < 0.01
