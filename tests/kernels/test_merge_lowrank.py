"""The fused merge kernel against its PyTorch reference and float64 math.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest); on CUDA it is compiled.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import merge_lowrank, merge_lowrank_reference, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m, n, ranks, wdtype, fdtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = sum(ranks)
    w = torch.randn(m, n, generator=g).to(wdtype).to(DEVICE)
    up = (torch.randn(m, r, generator=g) * 0.3).to(fdtype).to(DEVICE)
    down = (torch.randn(r, n, generator=g) * 0.3).to(fdtype).to(DEVICE)
    seg = [0]
    for k in ranks:
        seg.append(seg[-1] + k)
    scales = [0.5 + 0.37 * i * (-1) ** i for i in range(len(ranks))]
    return w, up, down, seg, scales


def _float64(w, up, down, seg, scales):
    acc = w.double()
    for i, a in enumerate(scales):
        acc += a * (up[:, seg[i]:seg[i + 1]].double() @ down[seg[i]:seg[i + 1]].double())
    return acc


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("m", "n", "ranks"), [(70, 45, [5, 7]), (33, 130, [70]), (16, 16, [1]), (20, 24, [300, 3])]
)
def test_kernel_matches_reference_bit_for_bit(wdtype, fdtype, m, n, ranks):
    w, up, down, seg, scales = _case(m, n, ranks, wdtype, fdtype)
    got, want = w.clone(), w.clone()
    merge_lowrank(got, up, down, seg, scales)
    merge_lowrank_reference(want, up, down, seg, scales)
    # Both sum in float32 and round once; only float32 summation order may differ, which can
    # move a value across a rounding boundary in rare cases: allow one ulp on a few elements.
    diff = (got.double() - want.double()).abs()
    ulp = (torch.nextafter(want, torch.full_like(want, torch.inf)).double() - want.double()).abs()
    assert bool((diff <= ulp).all())
    assert int((got != want).sum()) <= max(4, got.numel() // 100)
    # and the result is the float64 update rounded once, to within that same ulp
    ref = _float64(w, up, down, seg, scales).to(wdtype)
    assert int((got != ref).sum()) <= max(4, got.numel() // 100)


def test_float32_weight_close_to_float64():
    w, up, down, seg, scales = _case(40, 50, [8, 3], torch.float32, torch.float32)
    got = w.clone()
    merge_lowrank(got, up, down, seg, scales)
    torch.testing.assert_close(got.double(), _float64(w, up, down, seg, scales), rtol=1e-6,
                               atol=1e-5)


def test_row_slice_view_leaves_other_rows_alone():
    w, up, down, seg, scales = _case(64, 40, [4], torch.bfloat16, torch.bfloat16)
    full = w.clone()
    merge_lowrank(full[16:40], up[16:40], down, seg, scales)
    assert torch.equal(full[:16], w[:16]) and torch.equal(full[40:], w[40:])
    want = w[16:40].clone()
    merge_lowrank_reference(want, up[16:40], down, seg, scales)
    assert int((full[16:40] != want).sum()) <= 1


def test_single_rounding_differs_from_double_rounding():
    """The kernel rounds once; rounding the scaled product to bf16 first (cuBLAS addmm_ on bf16
    weights, PEFT's merge) gives different, less accurate weights."""
    w, up, down, seg, scales = _case(128, 128, [16], torch.bfloat16, torch.bfloat16)
    got = w.clone()
    merge_lowrank(got, up, down, seg, scales)
    ref = _float64(w, up, down, seg, scales).to(torch.bfloat16)
    double = w + (scales[0] * (up.float() @ down.float())).to(torch.bfloat16)
    assert int((got != ref).sum()) <= 16
    assert int((double != ref).sum()) > int((got != ref).sum())



@pytest.mark.parametrize(("dtype", "edge"), [(torch.float16, 65520.0),
                                             (torch.bfloat16, 2.0**128 - 2.0**119)])
def test_overflow_flag_set_exactly_where_a_sum_rounds_to_infinity(dtype, edge):
    """x just below the edge rounds to the largest finite value (no flag); at the edge it
    rounds to infinity (flag). An infinite weight before the merge is not the merge's doing."""
    w = torch.zeros(4, 16, dtype=dtype, device=DEVICE)
    up = torch.ones(4, 1, device=DEVICE)
    below = torch.nextafter(torch.tensor(edge), torch.tensor(0.0)).item()
    for value, flagged in ((below, 0), (edge, 1)):
        down = torch.full((1, 16), value, device=DEVICE)
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        got = w.clone()
        merge_lowrank(got, up, down, [0, 1], [1.0], overflow=flag)
        assert int(flag) == flagged
        assert bool(torch.isinf(got).all()) == bool(flagged)
    pre = w.clone()
    pre[0, 0] = float("inf")
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    merge_lowrank(pre, up, torch.ones(1, 16, device=DEVICE), [0, 1], [1.0], overflow=flag)
    assert int(flag) == 0


@pytest.fixture
def launches(monkeypatch):
    """Groups of at most two jobs a launch (to reach several chunks with few jobs); yields the
    launch grids."""
    import importlib

    mk = importlib.import_module("shuttle.kernels.merge_lowrank")
    monkeypatch.setattr(mk, "MAX_GROUP", 2)
    grids = []
    real = mk._kernel()

    class Counting:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(mk, "_kernel", lambda: Counting())
    return grids


def test_many_jobs_equal_one_launch_each_bit_for_bit(launches):
    """Jobs of two shapes and two dtypes, with and without several contributions: grouped
    launches (same shapes, strides and dtypes; groups of each kind growing 1, 2, ... up to
    MAX_GROUP) give the bits of one merge_lowrank per job."""
    from shuttle.kernels.merge_lowrank import LowRankJob, merge_lowrank_many

    cases = [_case(70, 45, [5, 7], torch.bfloat16, torch.bfloat16, seed=s) for s in range(5)]
    cases += [_case(33, 130, [16], torch.float16, torch.bfloat16, seed=s) for s in range(5, 7)]
    cases.append(_case(70, 45, [5, 7], torch.float16, torch.bfloat16, seed=7))
    want = []
    for w, up, down, seg, scales in cases:
        want.append(w.clone())
        merge_lowrank(want[-1], up, down, seg, scales)
    del launches[:]
    got = [w.clone() for w, *_ in cases]
    merge_lowrank_many([LowRankJob(g, *c[1:]) for g, c in zip(got, cases, strict=True)])
    for g, wt in zip(got, want, strict=True):
        assert torch.equal(g, wt)
    # bf16 70x45: 1, then 2, 2 (MAX_GROUP); fp16 33x130: 1, then the last one at the flush;
    # fp16 70x45: 1
    assert [grid[1] for grid in launches] == [1, 2, 2, 1, 1, 1]


def test_overlapping_jobs_never_share_a_launch(launches):
    """Row ranges of one weight that overlap cannot share a launch (their tiles would race):
    the later one waits for the earlier one's launch, and the rows both update take both
    updates in order. Disjoint row ranges of one weight do share launches."""
    from shuttle.kernels.merge_lowrank import LowRankJob, merge_lowrank_many

    w, up, down, seg, scales = _case(48, 40, [4], torch.bfloat16, torch.bfloat16)
    rows = [(0, 16), (16, 40), (32, 48)]  # the last two overlap
    per_rows = [scales, [-2 * scales[0]], [3 * scales[0]]]
    want = w.clone()
    for (r0, r1), a in zip(rows, per_rows, strict=True):
        merge_lowrank(want[r0:r1], up[r0:r1], down, seg, a)
    del launches[:]
    got = w.clone()
    merge_lowrank_many([LowRankJob(got[r0:r1], up[r0:r1], down, seg, a)
                        for (r0, r1), a in zip(rows, per_rows, strict=True)])
    assert torch.equal(got, want)
    assert [grid[1] for grid in launches] == [1, 1, 1]
    del launches[:]
    rows = [(0, 16), (16, 32), (32, 48)]
    merge_lowrank_many([LowRankJob(got[r0:r1], up[r0:r1], down, seg, scales) for r0, r1 in rows])
    assert [grid[1] for grid in launches] == [1, 2]


def test_overflow_flag_set_by_any_job_of_a_group(launches):
    """One flag shared by a group: its last job's overflow sets it; the others merge as
    usual."""
    from shuttle.kernels.merge_lowrank import LowRankJob, merge_lowrank_many

    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    ws = [torch.zeros(4, 16, dtype=torch.float16, device=DEVICE) for _ in range(3)]
    up = torch.ones(4, 1, device=DEVICE)
    ones, edge = torch.ones(1, 16, device=DEVICE), torch.full((1, 16), 65520.0, device=DEVICE)
    merge_lowrank_many([LowRankJob(w, up, d, [0, 1], [1.0], flag)
                        for w, d in zip(ws, (ones, ones, edge), strict=True)])
    assert int(flag) == 1 and [grid[1] for grid in launches] == [1, 2]
    assert bool((ws[0] == 1).all()) and bool((ws[1] == 1).all()) and bool(torch.isinf(ws[2]).all())


def test_a_contributions_scale_has_one_name_in_every_merge_kernel_and_representation():
    # strength x alpha / rank is a contribution's scale: the kernels, their wrappers and every
    # representation's merge_lowrank take it as ``scales``, never ``alpha`` (the file's alpha,
    # one factor of it).
    import importlib
    import inspect

    import shuttle.weights  # noqa: F401  (every representation registered)
    from shuttle.apply.fused_jobs import LowRankSum
    from shuttle.weights.representation import WeightRepresentation

    ml, nf4, scaled = (importlib.import_module(f"shuttle.kernels.{m}")
                       for m in ("merge_lowrank", "merge_nf4", "merge_scaled"))
    reps, todo = [], [WeightRepresentation]
    while todo:
        cls = todo.pop()
        reps.append(cls)
        todo.extend(cls.__subclasses__())
    fns = [ml.merge_lowrank, ml.merge_lowrank_reference, ml.padded_factors, nf4.merge_4bit,
           nf4.merge_4bit_reference, scaled.merge_scaled, scaled.merge_scaled_reference,
           scaled.merge_scaled_or_none]
    fns += [cls.merge_lowrank for cls in reps if "merge_lowrank" in vars(cls)]
    assert len(fns) > 8, "no representation overrides merge_lowrank"
    for f in fns:
        params = inspect.signature(f).parameters
        assert "scales" in params and "alpha" not in params, f.__qualname__
    assert "scales" in ml.LowRankJob._fields and "scales" in LowRankSum._fields
