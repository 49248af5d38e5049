"""Two scoped merges on one model, exited in either order: the weights come back bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import ScopeOrderError


def _lora(seed: int) -> shuttle.LoRA:
    g = torch.Generator().manual_seed(seed)
    return shuttle.load_lora({"0.lora_down.weight": torch.randn(2, 8, generator=g),
                              "0.lora_up.weight": torch.randn(6, 2, generator=g)})


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_order_restores(dtype):
    model = nn.Sequential(nn.Linear(8, 6)).to(dtype)
    before = _state(model)
    with shuttle.apply_lora(model, [(_lora(1), 0.7)]), \
            shuttle.apply_lora(model, [(_lora(2), 0.9)]):
        assert not torch.equal(model[0].weight, before["0.weight"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_of_order_exit_is_refused_and_the_later_exit_restores(dtype):
    model = nn.Sequential(nn.Linear(8, 6)).to(dtype)
    before = _state(model)
    a = shuttle.apply_lora(model, [(_lora(1), 0.7)])
    b = shuttle.apply_lora(model, [(_lora(2), 0.9)])
    a.__enter__()
    b.__enter__()
    both = _state(model)
    with pytest.raises(ScopeOrderError, match="exited while a later one"):
        a.__exit__(None, None, None)
    assert all(torch.equal(v, both[k]) for k, v in model.state_dict().items())  # unchanged
    b.__exit__(None, None, None)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with shuttle.apply_lora(model, [(_lora(1), 0.7)]):  # the model is usable again
        pass
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
