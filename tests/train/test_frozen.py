"""frozen_linear: what a base layer reads as (plain, float8, a parametrized weight), the
typed refusals of what the fast path cannot treat as a frozen Linear, and of an ``nn.Linear``
passed to the training functions in its place."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parametrize

from shuttle.errors import UnsupportedBaseError
from shuttle.train import frozen_linear, lora_linear, lora_mlp, lora_projections
from tests.train import linear


class _Doubled(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return 2 * t


def test_a_plain_layer_reads_as_its_weight_detached_and_its_bias():
    layer = linear(6, 4)
    base = frozen_linear(layer)
    assert base.kind == "plain" and (base.out_features, base.in_features) == (4, 6)
    assert base.data.data_ptr() == layer.weight.data_ptr() and base.data is not layer.weight
    assert base.bias is layer.bias
    assert base.weight(torch.float64) is base.data
    assert frozen_linear(linear(6, 4, bias=False)).bias is None


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_a_parametrized_weight_or_bias_is_read_through_its_parametrization(name):
    """A parametrization makes the tensor a property (not in ``_parameters``): the layer reads
    as what its forward computes with."""
    layer = linear(6, 4)
    parametrize.register_parametrization(layer, name, _Doubled())
    layer.requires_grad_(False)
    base = frozen_linear(layer)
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(x @ base.weight(x.dtype).T + base.bias, layer(x))


def test_a_float8_weight_reads_as_float8():
    layer = linear(8, 4, torch.float32)
    layer.weight = torch.nn.Parameter(layer.weight.to(torch.float8_e4m3fn), requires_grad=False)
    base = frozen_linear(layer)
    assert base.kind == "float8"
    torch.testing.assert_close(base.weight(torch.float32), layer.weight.float())


@pytest.mark.parametrize("make, reason", [
    (lambda: linear(6, 4).requires_grad_(True), "trainable"),
    (lambda: _with(linear(6, 4), bias_grad=True), "bias is trainable"),
    (lambda: torch.nn.Conv1d(4, 4, 1), "Conv1d base layer"),
    (lambda: _with(linear(6, 4), dtype=torch.int8), "torch.int8 weight"),
])
def test_what_is_not_a_frozen_linear_is_refused_by_name(make, reason):
    with pytest.raises(UnsupportedBaseError, match=reason):
        frozen_linear(make())


def _with(layer: torch.nn.Linear, bias_grad: bool = False,
          dtype: torch.dtype | None = None) -> torch.nn.Linear:
    if bias_grad:
        layer.bias.requires_grad_(True)
    if dtype is not None:
        layer.weight = torch.nn.Parameter(torch.ones(layer.weight.shape, dtype=dtype),
                                          requires_grad=False)
    return layer


@pytest.mark.parametrize("call", ["lora_linear", "lora_mlp", "lora_projections"])
def test_an_nn_linear_given_as_the_base_is_refused_naming_frozen_linear(call):
    x = torch.randn(3, 6, dtype=torch.float64)
    a, b = torch.randn(2, 6, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    raw, frozen = linear(6, 6), frozen_linear(linear(6, 6))
    calls = {"lora_linear": lambda: lora_linear(x, raw, a, b, 1.0),
             # the raw layer in the last place: every base is checked, not only the first
             "lora_mlp": lambda: lora_mlp(x, "silu", (frozen, a, b, 1.0), (frozen, None, None,
                                                                            1.0),
                                          (raw, None, None, 1.0)),
             "lora_projections": lambda: lora_projections(x, (frozen, a, b, 1.0),
                                                          (raw, None, None, 1.0))}
    with pytest.raises(UnsupportedBaseError, match=rf"{call}: .* Linear, not a FrozenLinear; "
                                                   r"pass shuttle.train.frozen_linear\(layer\)"):
        calls[call]()
