"""The one hook interface: chaining order, exact detach, groups."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from shuttle.errors import ShuttleError
from shuttle.hooks import HookGroup, ModuleHook, add_hook, hooks_of, remove_hook


class Tag(ModuleHook):
    """Records its calls in ``log``; scales the output by ``k``."""

    def __init__(self, name, log, k=1.0):
        self.name, self.log, self.k = name, log, k

    def pre_forward(self, module, args, kwargs):
        self.log.append(f"pre {self.name}")
        return args, kwargs

    def forward(self, module, inner, *args, **kwargs):
        self.log.append(f"enter {self.name}")
        out = inner(*args, **kwargs)
        self.log.append(f"leave {self.name}")
        return out

    def post_forward(self, module, output):
        self.log.append(f"post {self.name}")
        return output * self.k


def test_chain_order_and_outputs():
    lin, log = nn.Linear(3, 2), []
    x = torch.randn(4, 3)
    add_hook(lin, Tag("a", log, 2.0))
    add_hook(lin, Tag("b", log, 3.0))
    assert torch.allclose(lin(x), 6.0 * nn.functional.linear(x, lin.weight, lin.bias))
    assert log == ["pre a", "pre b", "enter a", "enter b", "leave b", "leave a", "post b",
                   "post a"]


def test_an_outermost_hook_goes_first_whenever_it_is_added():
    lin, log = nn.Linear(3, 2), []
    add_hook(lin, Tag("a", log))
    add_hook(lin, Tag("stream", log), outermost=True)
    add_hook(lin, Tag("b", log))
    lin(torch.randn(1, 3))
    assert [h.name for h in hooks_of(lin)] == ["stream", "a", "b"]
    assert log[:3] == ["pre stream", "pre a", "pre b"]
    assert log[3:6] == ["enter stream", "enter a", "enter b"]
    remove_hook(lin)
    assert "forward" not in lin.__dict__


def test_remove_restores_the_module_exactly():
    lin = nn.Linear(3, 2)
    sig = inspect.signature(lin.forward)
    hook = Tag("a", [])
    add_hook(lin, hook)
    assert hooks_of(lin) == [hook] and inspect.signature(lin.forward) == sig
    with pytest.raises(ShuttleError, match="already attached"):
        add_hook(lin, hook)
    remove_hook(lin, hook)
    assert "forward" not in lin.__dict__ and hooks_of(lin) == []
    assert type(lin) is nn.Linear


def test_a_foreign_instance_forward_is_refused():
    lin = nn.Linear(3, 2)
    lin.forward = lambda x: x
    with pytest.raises(ShuttleError, match="instance-level forward"):
        add_hook(lin, ModuleHook())


def test_group_removes_its_hooks_last_first_and_only_its_own():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    mine, other = HookGroup(), Tag("other", [])
    add_hook(a, other)
    detached = []

    class Spy(ModuleHook):
        def on_detach(self, module):
            detached.append((module, self))

    h1, h2, h3 = Spy(), Spy(), Spy()
    mine.add(a, h1)
    mine.add(b, h2)
    mine.add(a, h3)
    assert len(mine) == 3 and hooks_of(a) == [other, h1, h3]
    mine.remove_all()
    assert detached == [(a, h3), (b, h2), (a, h1)] and len(mine) == 0
    assert hooks_of(a) == [other] and "forward" not in b.__dict__


def test_substituted_reads_the_tensors_and_restores_the_same_parameters_on_error():
    from shuttle.hooks import substituted

    lin = torch.nn.Linear(3, 2)
    weight, bias = lin.weight, lin.bias
    x = torch.randn(4, 3)
    other = torch.randn(2, 3)
    with substituted(lin, {"weight": other}):
        assert torch.equal(lin(x), torch.nn.functional.linear(x, other, bias))
    assert lin.weight is weight and list(lin._parameters) == ["weight", "bias"]
    with pytest.raises(RuntimeError, match="boom"), substituted(lin, {"bias": torch.zeros(2)}):
        raise RuntimeError("boom")
    assert lin.bias is bias
    with pytest.raises(ShuttleError, match="no parameter"), substituted(lin, {"scale": other}):
        pass
    assert lin.weight is weight


def test_a_deep_copy_of_a_hooked_module_runs_its_own_weights_and_hooks():
    # EMA copies and model snapshots are made with copy.deepcopy while hooks are attached.
    import copy

    class Scale(ModuleHook):
        def __init__(self, k):
            self.k = k

        def post_forward(self, module, output):
            return output * self.k

    lin = nn.Linear(3, 2)
    add_hook(lin, Scale(2.0))
    twin = copy.deepcopy(lin)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.fill_(1.0)
    hooks_of(twin)[0].k = 3.0
    x = torch.randn(4, 3)
    assert torch.equal(twin(x), torch.full((4, 2), 3.0))
    assert torch.allclose(lin(x), 2 * torch.nn.functional.linear(x, lin.weight, lin.bias))
    remove_hook(twin)
    assert "forward" not in twin.__dict__ and torch.equal(twin(x), torch.ones(4, 2))
    assert hooks_of(lin)


@pytest.mark.parametrize("name", ["running_mean", "num_batches_tracked"])
def test_substituted_refuses_a_buffer_and_leaves_the_module(name):
    from shuttle.hooks import substituted

    bn = torch.nn.BatchNorm1d(3)
    params, buffers = dict(bn._parameters), dict(bn._buffers)
    keys = list(bn.state_dict())
    with pytest.raises(ShuttleError, match=f"\\['{name}'\\] of BatchNorm1d are buffers"), \
            substituted(bn, {"weight": torch.ones(3), name: torch.zeros(3)}):
        pass
    assert dict(bn._parameters) == params and dict(bn._buffers) == buffers
    assert all(bn._parameters[k] is v for k, v in params.items())
    assert list(bn.state_dict()) == keys
