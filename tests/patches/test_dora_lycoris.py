"""LyCORIS DoRA (``dora_scale``) at any strength, against lycoris-lora itself.

lycoris-lora (4.x) wraps a small torch model with ``create_lycoris(model, k, dim, alpha,
algo=..., dora_wd=True, wd_on_output=...)``, its factors and magnitudes are set to random
values, and ``save_weights`` writes the file. shuttle loads that file and merges it at strength
``k`` into a fresh copy of the model; the outputs are compared with LyCORIS's own forward at
multiplier ``k`` and the weights with its ``merge_to(k)`` (float32 throughout).

LyCORIS computes ``V * (k * (m / (||V|| + eps) - 1) + 1)`` with ``V = W + s * delta``, which is
``V + k * (D - V)``; ComfyUI's ``W + k * (D - W)`` agrees with it only at ``k = 1``.
LyCORIS's LoHa/LoKr ``merge_to`` applies ``(alpha / r)^2`` (docs/formats.md), so their merges
are compared with ``alpha = dim`` only; the forward comparisons use ``alpha != dim``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle

lycoris = pytest.importorskip("lycoris")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = {"rtol": 1e-5, "atol": 1e-6}
DIM = 4


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 12)
        self.b = nn.Linear(256, 128)  # large enough for LoKr to decompose w2 (scale alpha/r)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)

    def forward(self, x, y, img):
        return self.a(x), self.b(y), self.conv(img)


def make_base() -> Base:
    torch.manual_seed(0)
    return Base()


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 16, generator=g), torch.randn(3, 256, generator=g),
            torch.randn(2, 4, 5, 5, generator=g))


def lycoris_net(base: nn.Module, algo: str, on_out: bool, alpha: float, path):
    """LyCORIS's network on a copy of ``base`` with random weights, saved to ``path``."""
    logging.getLogger("LyCORIS").setLevel(logging.ERROR)
    model = copy.deepcopy(base)
    net = lycoris.create_lycoris(model, 1.0, DIM, alpha, algo=algo, dora_wd=True,
                                 wd_on_output=on_out)
    net.apply_to()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("dora_scale"):  # the initial norms, moved away from them
                p.mul_(torch.rand(p.shape, generator=g) + 0.5)
            else:  # lora_up / LoKr w1 start at zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    net.save_weights(str(path), torch.float32, None)
    return net, model


def outputs(model: nn.Module) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(*inputs())


def assert_all_close(actual, expected, **tol) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **(tol or TOL))


ALGOS = ["lora", "loha", "lokr"]
AXES = pytest.mark.parametrize("on_out", [True, False], ids=["rows", "columns"])


@pytest.mark.parametrize("k", [1.0, 0.5])
@AXES
@pytest.mark.parametrize("algo", ALGOS)
def test_forward_equals_lycoris(tmp_path, algo, on_out, k):
    base = make_base()
    net, model = lycoris_net(base, algo, on_out, alpha=DIM / 2, path=tmp_path / "a.safetensors")
    net.set_multiplier(k)
    expected = outputs(model)  # LyCORIS's forward at multiplier k
    lora = shuttle.load_lora(tmp_path / "a.safetensors")

    merged = copy.deepcopy(base)
    report = shuttle.merge_lora(merged, [(lora, k)])
    assert not report.unmatched and len(report.applied) == 3
    assert_all_close(outputs(merged), expected)

    dynamic = copy.deepcopy(base)
    with shuttle.apply_lora(dynamic, [(lora, k)], mode="dynamic"):
        assert_all_close(outputs(dynamic), expected)


@pytest.mark.parametrize("k", [1.0, 0.5])
@AXES
@pytest.mark.parametrize("algo", ALGOS)
def test_merge_equals_lycoris_merge_to(tmp_path, algo, on_out, k):
    base = make_base()
    net, model = lycoris_net(base, algo, on_out, alpha=DIM, path=tmp_path / "a.safetensors")
    net.merge_to(k)  # writes the merged weights into model's own layers
    merged = copy.deepcopy(base)
    shuttle.merge_lora(merged, [(tmp_path / "a.safetensors", k)])
    for name in ("a", "b", "conv"):
        torch.testing.assert_close(getattr(merged, name).weight, getattr(model, name).weight,
                                   **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_comfy_rule_differs_below_one(tmp_path):
    # The same file under ComfyUI's rule: equal at strength 1, not at 0.5.
    base = make_base()
    net, model = lycoris_net(base, "lora", True, alpha=2.0, path=tmp_path / "a.safetensors")
    for k, same in ((1.0, True), (0.5, False)):
        net.set_multiplier(k)
        expected = outputs(model)
        merged = copy.deepcopy(base)
        shuttle.merge_lora(merged, [(shuttle.load_lora(tmp_path / "a.safetensors",
                                                       dora="comfy"), k)])
        got = outputs(merged)
        err = max((a - e).abs().max().item() for a, e in zip(got, expected, strict=True))
        assert (err < 1e-5) == same, (k, err)


@pytest.mark.parametrize("metadata", [{"ss_network_module": "lycoris.kohya"}, {}],
                         ids=["lycoris.kohya", "no-sign"])
def test_kohya_names(tmp_path, metadata):
    # sd-scripts with --network_module lycoris.kohya: kohya's lora_unet_ names, LyCORIS named
    # only in the metadata. Without that sign the file gets ComfyUI's rule.
    base = make_base()
    net, model = lycoris_net(base, "lora", True, alpha=2.0, path=tmp_path / "a.safetensors")
    sd = {k.replace("lycoris_", "lora_unet_", 1): v
          for k, v in load_file(str(tmp_path / "a.safetensors")).items()}
    save_file(sd, str(tmp_path / "k.safetensors"), metadata=metadata)
    lora = shuttle.load_lora(tmp_path / "k.safetensors")
    assert {p.mode for _, p in lora.patches()} == {"lycoris" if metadata else "blend"}
    net.set_multiplier(0.5)
    merged = copy.deepcopy(base)
    shuttle.merge_lora(merged, [(lora, 0.5)])
    if metadata:
        assert_all_close(outputs(merged), outputs(model))
    else:
        assert not torch.allclose(outputs(merged)[0], outputs(model)[0], **TOL)
