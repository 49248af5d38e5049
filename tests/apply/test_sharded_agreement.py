"""The ranks of a sharded merge agree before any writes (:func:`shuttle.apply.sharded.agreed`):
ranks given different work (another strength, another adapter with the same keys and shapes,
another seed) all raise ``RankMismatchError`` and change no shard, for ``merge_lora``,
``apply_lora(mode="merge")`` and ``load_checkpoint``; the fingerprint they compare
(:func:`~shuttle.apply.sharded.merge_fingerprint`) tells such merges apart. And stochastic
rounding into a sharded encoded (tensor-subclass) shard is refused, as documented."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.plan import plan_merge
from shuttle.apply.sharded import merge_fingerprint
from tests import lowrank_state
from tests.ranks import backends, rank_device, run_ranks

pytest.importorskip("torch.distributed.tensor")

SHAPES = {"0": (13, 8), "1": (6, 13)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 13), nn.Linear(13, 6)).to(rank_device(), torch.bfloat16)


def _adapter(nudge: bool = False) -> dict[str, torch.Tensor]:
    sd = lowrank_state(SHAPES, rank=4, scale=0.3, seed=3)
    if nudge:  # one element, not among the 16 that rounding.merge_seed samples
        sd["0.lora_A.weight"][0, 1] += 1e-3
    return sd


# -- the fingerprint, in one process ----------------------------------------------------------

def _fingerprint(loras, rounding=None, seed=None, mapping=None) -> bytes:
    return merge_fingerprint(plan_merge(_model(), loras, mapping), rounding, seed)


def test_the_fingerprint_tells_apart_what_changes_the_merge():
    base = _fingerprint([(_adapter(), 0.7)])
    assert _fingerprint([(_adapter(), 0.7)]) == base  # other tensor objects, same values
    others = [_fingerprint([(_adapter(), 0.75)]), _fingerprint([(_adapter(nudge=True), 0.7)]),
              _fingerprint([(_adapter(), 0.7)], rounding="nearest"),
              _fingerprint([(_adapter(), 0.7)], seed=1),
              _fingerprint([(_adapter(), 0.7), (_adapter(), 0.1)]),
              _fingerprint([({k: v for k, v in _adapter().items() if k.startswith("0.")}, 0.7)])]
    assert len({base, *others}) == len(others) + 1


def test_a_tensor_modified_in_place_is_hashed_again():
    sd = _adapter()
    model = _model()
    before = merge_fingerprint(plan_merge(model, [(sd, 0.7)]))
    sd["1.lora_B.weight"][3, 3] += 1.0  # the same tensor object: its version counter moves
    assert merge_fingerprint(plan_merge(model, [(sd, 0.7)])) != before


# -- ranks given different merges --------------------------------------------------------------

def _sharded_model(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _model()
    mesh = init_device_mesh(rank_device().type, (world,))
    for lin in model:
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]),
                                  requires_grad=False)
    return model


def _mismatch_cases(rank, world, path):
    """Per case: the error each rank raised, and whether its shards are unchanged."""
    from shuttle.errors import RankMismatchError

    other = rank == 1
    inside: list[list[torch.Tensor]] = []  # the shards within a scoped merge

    def scoped(m):
        with shuttle.apply_lora(m, [(_adapter(), 0.75 if other else 0.7)], mode="merge"):
            inside.append([lin.weight.to_local().clone() for lin in m])

    calls = {
        "strength": lambda m: shuttle.merge_lora(m, [(_adapter(), 0.75 if other else 0.7)]),
        "adapter": lambda m: shuttle.merge_lora(m, [(_adapter(nudge=other), 0.7)]),
        "seed": lambda m: shuttle.merge_lora(m, [(_adapter(), 0.7)], seed=1 if other else None),
        "scoped": scoped,
        "load": lambda m: shuttle.load_checkpoint(
            m, path, loras=[(_adapter(nudge=other), 0.7)]),
    }
    out = []
    for case, call in calls.items():
        inside.clear()
        model = _sharded_model(world)
        before = [lin.weight.to_local().clone() for lin in model]
        try:
            call(model)
            raised = None
        except RankMismatchError as e:
            raised = type(e).__name__
            assert "ranks [0] vs [1]" in str(e), str(e)
        unchanged = all(torch.equal(now, b) for shards in (
            [lin.weight.to_local() for lin in model], *inside)
            for now, b in zip(shards, before, strict=True))
        out.append((case, raised, unchanged))
    model, ref = _sharded_model(world), _model()  # the same call on every rank merges
    shuttle.merge_lora(model, [(_adapter(), 0.7)])
    shuttle.merge_lora(ref, [(_adapter(), 0.7)])
    out.append(("same", None, all(torch.equal(lin.weight.full_tensor(), r.weight.detach())
                                  for lin, r in zip(model, ref, strict=True))))
    return out


@pytest.mark.parametrize("backend", backends(2))
def test_ranks_given_different_merges_all_refuse_and_change_nothing(tmp_path, backend):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in _model().state_dict().items()}, str(path))
    cases = ("strength", "adapter", "seed", "scoped", "load")
    want = [(c, "RankMismatchError", True) for c in cases] + [("same", None, True)]
    assert run_ranks(_mismatch_cases, 2, str(path), backend=backend) == [want, want]


# -- stochastic rounding into an encoded shard --------------------------------------------------

class _Coded(torch.Tensor):
    """Stands in for an encoded weight (NF4 blocks, scaled float8): a tensor subclass local
    shard, which shuttle does not treat as a plain tensor."""


def _encoded_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from shuttle.errors import UnsupportedPlacementError

    mesh = init_device_mesh(rank_device().type, (world,))
    model = _model()
    w = model[0].weight.detach()
    local = w.chunk(world)[rank].clone().as_subclass(_Coded)
    # the DTensor itself as the parameter: nn.Parameter() would unwrap the local subclass
    model[0]._parameters["weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                        shape=w.shape, stride=w.stride())
    before = model[0].weight.to_local().clone()
    out = []
    for rounding in (None, "stochastic", "nearest"):
        try:
            shuttle.merge_lora(model, [(_adapter(), 0.7)], rounding=rounding)
            raised = None
        except UnsupportedPlacementError as e:
            raised = "rounding='nearest'" in str(e) and "_Coded" in str(e)
        except shuttle.errors.ShuttleError as e:  # past the placement check (this toy
            raised = type(e).__name__          # encoding has no registered re-encoding)
        local = model[0].weight.to_local()
        out.append((rounding, raised, type(local) is _Coded and torch.equal(local, before)))
    return out


@pytest.mark.parametrize("backend", backends(2))
def test_stochastic_rounding_into_a_sharded_encoded_weight_is_refused(backend):
    want = [(None, True, True), ("stochastic", True, True),
            ("nearest", "UnmergeableWeightError", True)]
    assert run_ranks(_encoded_cases, 2, backend=backend) == [want, want]


# -- an overflow on one rank's shard ------------------------------------------------------------

def _overflow_cases(rank, world):
    """A float16 merge whose update overflows only the rows rank 1 holds: per call, the error
    each rank raised and whether its shards are unchanged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shuttle.errors import NonFiniteAdapterError, RankFailedError

    def sharded() -> nn.Module:
        model = _model().to(torch.float16)
        mesh = init_device_mesh(rank_device().type, (world,))
        with torch.no_grad():
            model[0].weight[7:] = 65504.0  # float16's largest: rank 1's rows 7..12
        for lin in model:
            lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]),
                                      requires_grad=False)
        return model

    def scoped(m):
        with shuttle.apply_lora(m, [(_adapter(), 200.0)], mode="merge"):
            pass

    out = []
    for case, call in (("merge", lambda m: shuttle.merge_lora(m, [(_adapter(), 200.0)])),
                       ("scoped", scoped)):
        model = sharded()
        before = [lin.weight.to_local().clone() for lin in model]
        try:
            call(model)
            raised = None
        except (NonFiniteAdapterError, RankFailedError) as e:
            raised = type(e).__name__
        out.append((case, raised, all(torch.equal(lin.weight.to_local(), b)
                                      for lin, b in zip(model, before, strict=True))))
    return out


@pytest.mark.parametrize("backend", backends(2))
def test_an_overflow_on_one_ranks_shard_leaves_every_rank_unchanged(backend):
    ok = [(c, "RankFailedError", True) for c in ("merge", "scoped")]
    failed = [(c, "NonFiniteAdapterError", True) for c in ("merge", "scoped")]
    assert run_ranks(_overflow_cases, 2, backend=backend) == [ok, failed]
