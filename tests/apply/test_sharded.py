"""Merges into DTensor parameters on 2 and 4 ranks (gloo on the CPU; NCCL, one GPU a rank, where
the machine has the GPUs): every shard equals the same window of a single-process merge (even
and uneven shards, rows, columns, 2-D meshes, split q/k/v on a fused qkv), scoped merges
restore each shard bit for bit, and bad input (a failing rank, Partial placements, DTensor
factors) changes nothing on any rank; dynamic LoRA on tensor-parallel and FSDP2 layers and
checkpoint loads into FSDP2 and tensor-parallel models equal the single-device results.
Ranks given different merges: test_sharded_agreement.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from tests import lowrank_state
from tests.ranks import backends, rank_device, run_ranks, worlds_and_backends

pytest.importorskip("torch.distributed.tensor")

SHAPES = {"0": (13, 8), "1": (6, 13)}  # 13 rows: uneven on 2 and 4 ranks


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 13), nn.Linear(13, 6)).to(rank_device(), dtype)


def _adapter() -> dict[str, torch.Tensor]:
    return lowrank_state(SHAPES, rank=4, scale=0.3, seed=3)


def _shard(model: nn.Module, mesh, placements) -> None:
    from torch.distributed.tensor import distribute_tensor

    for lin in model:
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, placements),
                                  requires_grad=False)


def _mesh(world: int, dims: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rank_device().type, dims)


def _placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return [{"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}[p] for p in spec.split(",")]


def _merge_case(rank, world, dims, spec, dtype, scoped):
    model = _model(dtype)
    before = [lin.weight.detach().clone() for lin in model]
    ref = _model(dtype)
    shuttle.merge_lora(ref, [(_adapter(), 0.7)])
    _shard(model, _mesh(world, dims), _placements(spec))
    if scoped:
        with shuttle.apply_lora(model, [(_adapter(), 0.7)], mode="merge"):
            inside = [lin.weight.full_tensor() for lin in model]
        after = [lin.weight.full_tensor() for lin in model]
        return inside, [r.weight.detach() for r in ref], after, before
    shuttle.merge_lora(model, [(_adapter(), 0.7)])
    return [lin.weight.full_tensor() for lin in model], [r.weight.detach() for r in ref]


CASES = {2: [((2,), "S0"), ((2,), "S1"), ((2,), "R")],
         4: [((4,), "S0"), ((2, 2), "S0,S1"), ((2, 2), "S0,S0"), ((2, 2), "R,S1")]}
DTYPES = (torch.float32, torch.bfloat16)


def _merge_cases(rank, world):
    """Every case of this world size and dtype in one process group (a spawn costs seconds)."""
    return [(dims, spec, dtype, _merge_case(rank, world, dims, spec, dtype, False))
            for dims, spec in CASES[world] for dtype in DTYPES]


@pytest.mark.parametrize(("world", "backend"), worlds_and_backends(2, 4))
def test_each_shard_is_the_window_of_the_single_process_merge(world, backend):
    # bf16: bit for bit. float32: the same sums, but CPU BLAS picks other kernels for a shard
    # of one or a few rows, which may round the last bit differently.
    for cases in run_ranks(_merge_cases, world, backend=backend):
        for dims, spec, dtype, (got, want) in cases:
            for g, w in zip(got, want, strict=True):
                msg = f"mesh {dims}, placements {spec}, {dtype}"
                if dtype == torch.bfloat16:
                    assert torch.equal(g, w), msg
                else:
                    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=msg)


# Stochastic rounding into shards: float8 by default, bfloat16 when asked.
DRAWN = {torch.float8_e4m3fn: None, torch.bfloat16: "stochastic"}


def _as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    for lin in model:
        lin.weight = nn.Parameter(lin.weight.detach().to(dtype), requires_grad=False)
    return model


def _drawn_cases(rank, world):
    """Per case, per weight: this rank's window and its shard's bytes after the merge."""
    from shuttle.weights.dtensor import shard_window

    out = []
    for dims, spec in CASES[world]:
        for dtype, rounding in DRAWN.items():
            model = _model(torch.bfloat16)
            _shard(model, _mesh(world, dims), _placements(spec))
            _as(model, dtype)  # a DTensor converts shard by shard
            shuttle.merge_lora(model, [(_adapter(), 0.7)], rounding=rounding)
            shards = []
            for i, lin in enumerate(model):
                w = shard_window(lin.weight, str(i))
                local = lin.weight.to_local()
                shards.append((w.starts, w.stops, local.view(torch.uint8) if dtype.itemsize == 1
                               else local.view(torch.int16)))
            out.append((dims, spec, dtype, shards))
    return out


def _drawn_reference(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per weight: the stochastic merge of the whole weight with the draws of its global
    element indices, and the float32 value it rounds."""
    from shuttle.apply.param_merge import apply_contributions
    from shuttle.apply.plan import plan_merge
    from shuttle.apply.rounding import merge_seed
    from shuttle.kernels.rounding import GlobalDraws, round_float

    model = _as(_model(torch.bfloat16), dtype)
    plan = plan_merge(model, [(_adapter(), 0.7)])
    out = []
    for name, p in model.named_parameters():
        if name not in plan.params:
            continue
        contribs = plan.params[name]
        exact = apply_contributions(p.detach().float(), contribs)
        if dtype.itemsize == 1:
            exact = exact.clamp(-448.0, 448.0)
        draws = GlobalDraws(merge_seed(name, None, contribs), (0, 0), tuple(p.shape))
        out.append((round_float(exact, dtype, "stochastic", noise=draws.uniform(p.shape, "cpu")),
                    exact))
    return out


@pytest.mark.parametrize(("world", "backend"), worlds_and_backends(2, 4))
def test_stochastic_merges_into_shards_give_the_same_bits_on_any_world_size(world, backend):
    refs = {dtype: _drawn_reference(dtype) for dtype in DRAWN}
    for dtype, ref in refs.items():  # the reference is a stochastic rounding of the exact sum:
        view = torch.uint8 if dtype.itemsize == 1 else torch.int16
        for r, exact in ref:  # the nearest value, or its neighbour on the other side of exact
            n = exact.to(dtype)
            other = (r.float() - exact).sign() != (n.float() - exact).sign()
            step = (r.view(view).int() - n.view(view).int()).abs()
            assert bool(((step == 0) | ((step == 1) & other) | (n.float() == 0)).all())
            assert bool((step == 1).any())  # not all nearest
    for cases in run_ranks(_drawn_cases, world, backend=backend):
        for dims, spec, dtype, shards in cases:
            for (starts, stops, got), (want, _) in zip(shards, refs[dtype], strict=True):
                window = want[starts[0]:stops[0], starts[1]:stops[1]]
                bits = window.view(torch.uint8) if dtype.itemsize == 1 else window.view(
                    torch.int16)
                assert torch.equal(got, bits), f"mesh {dims}, placements {spec}, {dtype}"


def _scoped_cases(rank, world):
    return [_merge_case(rank, world, (2,), spec, torch.bfloat16, True) for spec in ("S0", "S1")]


@pytest.mark.parametrize("backend", backends(2))
def test_scoped_merge_restores_every_shard_bit_for_bit(backend):
    for cases in run_ranks(_scoped_cases, 2, backend=backend):
        for inside, want, after, before in cases:
            for i, w, a, b in zip(inside, want, after, before, strict=True):
                assert torch.equal(i, w) and torch.equal(a, b)


def _failing_rank_case(rank, world):
    from shuttle.errors import RankFailedError, ShapeMismatchError

    model = _model(torch.float32)
    _shard(model, _mesh(world, (world,)), _placements("S0"))
    before = [lin.weight.full_tensor() for lin in model]
    sd = _adapter()
    if rank == 1:  # this rank's copy of the adapter is for another model
        sd["0.lora_B.weight"] = torch.randn(12, 4)
    try:
        shuttle.merge_lora(model, [(sd, 1.0)])
        raised = None
    except (ShapeMismatchError, RankFailedError) as e:
        raised = type(e).__name__
    after = [lin.weight.full_tensor() for lin in model]
    return raised, all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("backend", backends(2))
def test_a_failing_rank_leaves_every_shard_unchanged(backend):
    results = run_ranks(_failing_rank_case, 2, backend=backend)
    assert results == [("RankFailedError", True), ("ShapeMismatchError", True)]


def _bad_placement_case(rank, world, what):
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    from shuttle.errors import UnsupportedPlacementError

    model = _model(torch.float32)
    mesh = _mesh(world, (world,))
    sd = _adapter()
    if what == "partial":
        local = model[0].weight.detach() / world
        model[0].weight = nn.Parameter(DTensor.from_local(local, mesh, [Partial()]),
                                       requires_grad=False)
    else:
        _shard(model, mesh, _placements("S0"))
        sd = {k: distribute_tensor(v, mesh, _placements("R")) for k, v in sd.items()}
    before = [lin.weight.to_local().clone() if hasattr(lin.weight, "to_local")
              else lin.weight.detach().clone() for lin in model]
    with pytest.raises(UnsupportedPlacementError) as info:
        shuttle.merge_lora(model, [(sd, 1.0)])
    after = [lin.weight.to_local() if hasattr(lin.weight, "to_local") else lin.weight.detach()
             for lin in model]
    return str(info.value), all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _bad_placement_cases(rank, world):
    return [_bad_placement_case(rank, world, what) for what in ("partial", "factors")]


@pytest.mark.parametrize("backend", backends(2))
def test_unsupported_placements_are_refused_on_every_rank_before_any_change(backend):
    for cases in run_ranks(_bad_placement_cases, 2, backend=backend):
        for (text, unchanged), message in zip(cases, ("Partial", "DTensor"), strict=True):
            assert message in text and unchanged


def test_the_sharded_merge_example_runs_under_torchrun():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(root / "examples" / "sharded_merge.py")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "equal to the single-process merge" in out.stdout


def _tp_case(rank, world, dtype):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from shuttle.errors import UnsupportedPlacementError

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6)).to(rank_device(),
                                                                               dtype)

    sd = lowrank_state({"0": (12, 8), "2": (6, 12)}, rank=4, scale=0.5, seed=2)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3)).to(rank_device(), dtype)
    ref = make()
    handle_ref = shuttle.attach_lora(ref, [(sd, 0.7)])
    tp = make()
    base = tp(x)
    parallelize_module(tp, _mesh(world, (world,)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    handle = shuttle.attach_lora(tp, [(sd, 0.7)])
    outs = [(tp(x).clone(), ref(x))]
    handle.set_strength(0, -0.4)
    handle_ref.set_strength(0, -0.4)
    with shuttle.lora_scale(0.5):
        outs.append((tp(x).clone(), ref(x)))
    handle.detach()
    outs.append((tp(x).clone(), base))
    try:  # a dense patch cannot run on a sharded layer: refused, nothing attached
        shuttle.attach_lora(tp, [({"0.diff": torch.ones(12, 8)}, 1.0)])
        refused = False
    except UnsupportedPlacementError:
        refused = True
    # clone(): a row-parallel output is an AsyncCollectiveTensor until first used, and
    # pickling it to the parent would send the buffer before the all-reduce lands
    return [(a.float(), b.float()) for a, b in outs], refused


def _tp_cases(rank, world):
    return [(dtype, _tp_case(rank, world, dtype)) for dtype in DTYPES]


@pytest.mark.parametrize(("world", "backend"), worlds_and_backends(2, 4))
def test_dynamic_lora_on_tensor_parallel_layers_equals_the_single_device_result(world, backend):
    for cases in run_ranks(_tp_cases, world, backend=backend):
        for dtype, (outs, refused) in cases:
            tol = ({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else
                   {"rtol": 2e-2, "atol": 2e-2})
            for got, want in outs:
                torch.testing.assert_close(got, want, **tol, msg=str(dtype))
            assert refused


def _dynamic_styles_case(rank, world):
    """Outputs against the single-device model's: attach_lora on an FSDP2 model (whose forward
    sees the gathered, plain weights), apply_lora(mode="dynamic") on a tensor-parallel one, and
    split q/k/v factors on a column-parallel fused qkv; and whether mode="auto" is refused."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from shuttle.errors import UnsupportedPlacementError

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6)).to(rank_device())

    mesh = _mesh(world, (world,))
    sd = lowrank_state({"0": (12, 8), "2": (6, 12)}, rank=4, scale=0.5, seed=2)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3)).to(rank_device())
    ref = make()
    base = ref(x)
    handle_ref = shuttle.attach_lora(ref, [(sd, 0.7)])
    outs = []
    fsdp = make()
    fully_shard(fsdp, mesh=mesh)
    handle = shuttle.attach_lora(fsdp, [(sd, 0.7)])
    outs.append((fsdp(x), ref(x)))
    handle.set_strength(0, -0.4)
    handle_ref.set_strength(0, -0.4)
    outs.append((fsdp(x), ref(x)))
    handle.detach()
    outs.append((fsdp(x), base))
    handle_ref.set_strength(0, 0.7)
    tp = make()
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with shuttle.apply_lora(tp, [(sd, 0.7)], mode="dynamic"):
        outs.append((tp(x).clone(), ref(x)))
    outs.append((tp(x).clone(), base))
    try:
        with shuttle.apply_lora(tp, [(sd, 0.7)], mode="auto"):
            pass
        refused = False
    except UnsupportedPlacementError:
        refused = True
    block, block_ref = _Block().float(), _Block().float()
    parallelize_module(block.attn, mesh, {"qkv": ColwiseParallel(use_local_output=False)})
    shuttle.attach_lora(block, [(_split_qkv(), 0.7)])
    shuttle.attach_lora(block_ref, [(_split_qkv(), 0.7)])
    xq = x[:, :DIM]
    outs.append((block.attn.qkv(xq).full_tensor(), block_ref.attn.qkv(xq)))
    return [(a.detach(), b.detach()) for a, b in outs], refused


@pytest.mark.parametrize("backend", backends(2))
def test_dynamic_lora_on_fsdp2_and_tensor_parallel_models(backend):
    for outs, refused in run_ranks(_dynamic_styles_case, 2, backend=backend):
        for got, want in outs:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert refused


def _load_case(rank, world, path, style):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from shuttle.errors import UnsupportedPlacementError

    def make():
        torch.manual_seed(5)  # other weights than the checkpoint's
        return nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 6)).to(rank_device(),
                                                                               torch.bfloat16)

    sd = lowrank_state({"0": (13, 8), "2": (6, 13)}, rank=4, scale=0.3, seed=2)
    ref = make()
    shuttle.load_checkpoint(ref, path, loras=[(sd, 0.6)])
    model = make()
    mesh = _mesh(world, (world,))
    if style == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    params = dict(model.named_parameters())
    objects = {n: id(p) for n, p in params.items()}
    shuttle.load_checkpoint(model, path, loras=[(sd, 0.6)])
    same_objects = all(id(p) == objects[n] for n, p in model.named_parameters())
    got = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    want = dict(ref.named_parameters())
    # a meta DTensor cannot take its shard in place: refused before anything is read
    meta = make().to("meta")
    parallelize_module(meta, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    try:
        shuttle.load_checkpoint(meta, path)
        refused = False
    except UnsupportedPlacementError:
        refused = True
    return all(torch.equal(got[n], want[n].detach()) for n in want), same_objects, refused


def _load_cases(rank, world, path):
    return [_load_case(rank, world, path, style) for style in ("fsdp2", "tp")]


@pytest.mark.parametrize(("world", "backend"), worlds_and_backends(2, 4))
def test_load_checkpoint_into_sharded_models_writes_each_shard_in_place(tmp_path, world, backend):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 6)).to(torch.bfloat16)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(path))
    for cases in run_ranks(_load_cases, world, str(path), backend=backend):
        for equal, same_objects, refused in cases:  # FSDP2, then tensor parallel
            assert equal and same_objects and refused


def _read_bytes_case(rank, world, path):
    """Bytes this rank reads from the file loading a tensor-parallel and an FSDP2 model (no
    adapters), against the bytes of its row windows; and the loaded values."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from shuttle.formats.safetensors_file import SafetensorsFile
    from shuttle.weights.dtensor import shard_window

    read = []
    original = SafetensorsFile._read_copy

    def counting(self, begin, end, raw=None):
        read.append(end - begin)
        return original(self, begin, end, raw)

    SafetensorsFile._read_copy = counting
    want = load_file(path)
    out = []
    for style in ("tp", "fsdp2"):
        model = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 6)).to(rank_device(),
                                                                                torch.bfloat16)
        mesh = _mesh(world, (world,))
        if style == "fsdp2":
            fully_shard(model, mesh=mesh)
        else:
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        read.clear()
        shuttle.load_checkpoint(model, path)
        expect = 0
        for name, p in model.named_parameters():
            w = shard_window(p, name)
            row = p.element_size() * (p[0].numel() if p.dim() > 1 else 1)
            whole = w.covers(0, p.shape[0])
            expect += p.numel() * p.element_size() if whole else (w.stops[0] - w.starts[0]) * row
        equal = all(torch.equal(p.full_tensor().cpu(), want[n])
                    for n, p in model.named_parameters())
        out.append((sum(read), expect, equal))
    SafetensorsFile._read_copy = original
    return out


@pytest.mark.parametrize(("world", "backend"), worlds_and_backends(2, 4))
def test_a_rank_reads_only_the_rows_of_its_shards(tmp_path, world, backend):
    """Row-sharded tensors that no adapter changes are read by rows: a rank's reads are its
    shards' bytes (column-sharded and replicated tensors whole), not the checkpoint's."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 6)).to(torch.bfloat16)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(path))
    total = sum(v.numel() * v.element_size() for v in full.state_dict().values())
    for cases in run_ranks(_read_bytes_case, world, str(path), backend=backend):
        for got, expect, equal in cases:  # tensor parallel, then FSDP2
            assert equal and got == expect and got < total


# -- split q/k/v onto a row-sharded fused qkv --------------------------------------------------

DIM = 5  # qkv: 15 rows, 8 + 7 on 2 ranks: rank 0 holds q and k's first 3 rows, rank 1 the rest


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.attn = _Attn()
        self.to(rank_device(), torch.bfloat16)


def _split_qkv() -> dict[str, torch.Tensor]:
    """q, k and v's own factors (ranks 1, 2, 3), which land on rows 0-5, 5-10, 10-15 of qkv."""
    g = torch.Generator().manual_seed(7)
    sd = {}
    for i, leaf in enumerate(("to_q", "to_k", "to_v")):
        sd.update({f"attn.{leaf}.lora_A.weight": torch.randn(i + 1, DIM, generator=g) * 0.3,
                   f"attn.{leaf}.lora_B.weight": torch.randn(DIM, i + 1, generator=g) * 0.3})
    return sd


def _split_qkv_case(rank, world):
    import shuttle.weights.dtensor as sharded  # where a shard's update is cut (select_rows)
    from shuttle.errors import NonFiniteAdapterError, RankFailedError

    ref = _Block()
    report = shuttle.merge_lora(ref, [(_split_qkv(), 0.7)])
    assert report.applied == ["attn.qkv.weight"] and not report.unmatched
    want = ref.attn.qkv.weight.detach()

    def sharded_block():
        block = _Block()
        mesh = _mesh(world, (world,))
        block.attn.qkv.weight = nn.Parameter(distribute_tensor(
            block.attn.qkv.weight.detach(), mesh, _placements("S0")), requires_grad=False)
        return block

    from torch.distributed.tensor import distribute_tensor

    out = {}
    block = sharded_block()
    before = block.attn.qkv.weight.to_local().clone()
    with shuttle.apply_lora(block, [(_split_qkv(), 0.7)], mode="merge"):
        out["scoped"] = block.attn.qkv.weight.to_local().clone()
    out["restored"] = torch.equal(block.attn.qkv.weight.to_local(), before)
    shuttle.merge_lora(block, [(_split_qkv(), 0.7)])
    out["merged"] = block.attn.qkv.weight.to_local().clone()
    out["want"] = want[(0, 8)[rank]:(8, 15)[rank]]  # torch.chunk's rows: 0-8 and 8-15

    # one rank fails, the other does not: no rank's shard changes
    failures = []
    for how in ("nan", "raise"):
        block = sharded_block()
        before = block.attn.qkv.weight.to_local().clone()
        sd = _split_qkv()
        original = sharded.select_rows
        if rank == 1 and how == "nan":  # v's rows, held by rank 1 only, in its own copy
            sd["attn.to_v.lora_B.weight"][2, 0] = float("nan")
        if rank == 1 and how == "raise":  # cutting k's rows to this rank's window fails
            def failing(*args, **kwargs):
                raise RuntimeError("planted failure")
            sharded.select_rows = failing
        try:
            shuttle.merge_lora(block, [(sd, 0.7)])
            raised = None
        except (NonFiniteAdapterError, RankFailedError, RuntimeError) as e:
            raised = type(e).__name__
        finally:
            sharded.select_rows = original
        failures.append((how, raised, torch.equal(block.attn.qkv.weight.to_local(), before)))
    out["failures"] = failures
    return out


@pytest.mark.parametrize("backend", backends(2))
def test_split_qkv_onto_a_row_sharded_fused_weight(backend):
    """Each rank's shard of a fused qkv takes exactly its rows of q, k and v's updates (k's cut
    by the shard boundary), scoped merges restore it, and a failure on one rank changes no
    rank's shard."""
    results = run_ranks(_split_qkv_case, 2, backend=backend)
    for rank, out in enumerate(results):
        assert out["merged"].shape[0] == (8, 7)[rank]
        assert torch.equal(out["merged"], out["want"]), f"rank {rank}"
        assert torch.equal(out["scoped"], out["want"]) and out["restored"], f"rank {rank}"
    assert [out["failures"] for out in results] == [
        [("nan", "RankFailedError", True), ("raise", "RankFailedError", True)],
        [("nan", "NonFiniteAdapterError", True), ("raise", "RuntimeError", True)]]
