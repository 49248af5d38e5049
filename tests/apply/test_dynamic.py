"""Dynamic adapters: tiers against the reference chain and float64, every layer and patch kind,
exact detach, strengths, request scales and torch.compile without recompiles."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import (
    AdapterIndexError,
    InvalidOptionError,
    InvalidStrengthError,
    ShapeMismatchError,
)
from shuttle.hooks import hooks_of


def _lora_sd(prefix, out_f, in_f, rank, g, alpha=None, dtype=torch.bfloat16, scale=0.1):
    sd = {f"{prefix}.lora_A.weight": (torch.randn(rank, in_f, generator=g) * scale).to(dtype),
          f"{prefix}.lora_B.weight": (torch.randn(out_f, rank, generator=g) * scale).to(dtype)}
    if alpha is not None:
        sd[f"{prefix}.alpha"] = torch.tensor(float(alpha))
    return sd


def _linear_model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)).to(dtype)


def _reference_chain(x, a, b, scale, strength, req):
    """The chain the exact tier promises to reproduce: delta, then each scale, then add."""
    d = x @ a.T @ b.T
    for s in (scale, strength, req):
        if s != 1:
            d = d * s
    return d


@pytest.mark.parametrize(("alpha", "strength", "req"),
                         [(None, 1.0, 1.0), (8.0, 1.0, 1.0), (4.0, 0.7, 1.0), (8.0, 0.3, 0.5)])
@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 32)])
def test_exact_tier_is_bit_identical_to_the_reference_chain(alpha, strength, req, shape):
    g = torch.Generator().manual_seed(1)
    m = _linear_model()
    sd = _lora_sd("0", 48, 32, 8, g, alpha)
    x = torch.randn(*shape, generator=g).bfloat16()
    base = m[0](x)
    scale = (alpha / 8) if alpha is not None else 1.0
    want = base + _reference_chain(x, sd["0.lora_A.weight"], sd["0.lora_B.weight"], scale,
                                   strength, req)
    with shuttle.apply_lora(m, [(sd, strength)], mode="dynamic", quality="exact"), \
            shuttle.lora_scale(req):
        got = m[0](x)
    assert torch.equal(got, want)


def test_exact_tier_on_fused_rows():
    g = torch.Generator().manual_seed(2)
    m = nn.Module()
    m.to_qkv = nn.Linear(16, 48).bfloat16()
    sd = {}
    for n in ("to_q", "to_k", "to_v"):
        sd |= _lora_sd(n, 16, 16, 4, g)
    x = torch.randn(3, 16, generator=g).bfloat16()
    base = m.to_qkv(x)
    parts = [base[:, 16 * i:16 * (i + 1)] + _reference_chain(
        x, sd[f"{n}.lora_A.weight"], sd[f"{n}.lora_B.weight"], 1.0, 0.5, 1.0)
        for i, n in enumerate(("to_q", "to_k", "to_v"))]
    with shuttle.apply_lora(m, [(sd, 0.5)], mode="dynamic", quality="exact"):
        got = m.to_qkv(x)
    assert torch.equal(got, torch.cat(parts, dim=-1))


def _error(got, ref64):
    ref64 = ref64.detach()
    return float((got.detach().double() - ref64).norm() / ref64.norm())


@pytest.mark.parametrize("quality", ["lossless", "fused"])
@pytest.mark.parametrize("factor_dtype", [torch.bfloat16, torch.float32])
def test_fast_tiers_are_no_worse_than_exact_against_float64(quality, factor_dtype):
    g = torch.Generator().manual_seed(3)
    m = _linear_model()
    sds = [_lora_sd("0", 48, 32, 8, g, 4.0, factor_dtype, scale=0.3),
           _lora_sd("0", 48, 32, 5, g, None, factor_dtype, scale=0.3)]
    x = torch.randn(40, 32, generator=g).bfloat16()
    ref = torch.nn.functional.linear(x.double(), m[0].weight.double(), m[0].bias.double())
    for sd, s, k in ((sds[0], 0.5, 0.8), (sds[1], 1.0, -0.4)):
        ref = ref + k * s * (x.double() @ sd["0.lora_A.weight"].double().T
                             @ sd["0.lora_B.weight"].double().T)
    loras = [(sds[0], 0.8), (sds[1], -0.4)]
    with shuttle.apply_lora(m, loras, mode="dynamic", quality="exact"):
        exact = m[0](x)
    with shuttle.apply_lora(m, loras, mode="dynamic", quality=quality):
        fast = m[0](x)
    assert _error(fast, ref) <= _error(exact, ref) * 1.05
    assert _error(fast, ref) < 1e-2


@pytest.mark.parametrize("quality", ["exact", "lossless"])
def test_conv_and_embedding_low_rank(quality):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    m = nn.Module()
    m.conv = nn.Conv2d(3, 8, 3, padding=1)
    m.emb = nn.Embedding(20, 6)
    sd = {"conv.lora_down.weight": torch.randn(2, 3, 3, 3, generator=g) * 0.2,
          "conv.lora_up.weight": torch.randn(8, 2, 1, 1, generator=g) * 0.2,
          "conv.alpha": torch.tensor(1.0),
          "base_model.model.emb.lora_embedding_A": torch.randn(3, 20, generator=g),
          "base_model.model.emb.lora_embedding_B": torch.randn(6, 3, generator=g)}
    x = torch.randn(2, 3, 5, 5, generator=g)
    ids = torch.tensor([[1, 4, 19], [0, 2, 2]])
    merged = nn.Module()
    merged.conv, merged.emb = nn.Conv2d(3, 8, 3, padding=1), nn.Embedding(20, 6)
    merged.load_state_dict(m.state_dict())
    shuttle.merge_lora(merged, [(sd, 0.6)])
    with shuttle.apply_lora(m, [(sd, 0.6)], mode="dynamic", quality=quality):
        torch.testing.assert_close(m.conv(x), merged.conv(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.emb(ids), merged.emb(ids), rtol=1e-5, atol=1e-5)


def test_every_patch_kind_runs_dynamically():
    """LoHa, LoKr, full diff, bias diff, norm, (IA)3, set and DoRA: dynamic equals merged."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)

    def model():
        torch.manual_seed(0)
        m = nn.Module()
        m.a, m.b, m.c = nn.Linear(8, 8), nn.Linear(8, 6), nn.Linear(6, 4)
        m.d, m.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        return m

    sd = {"lycoris_a.hada_w1_a": torch.randn(8, 2, generator=g),
          "lycoris_a.hada_w1_b": torch.randn(2, 8, generator=g),
          "lycoris_a.hada_w2_a": torch.randn(8, 2, generator=g),
          "lycoris_a.hada_w2_b": torch.randn(2, 8, generator=g),
          "lycoris_b.lokr_w1": torch.randn(2, 2, generator=g),
          "lycoris_b.lokr_w2": torch.randn(3, 4, generator=g),
          "lycoris_b.diff_b": torch.randn(6, generator=g),
          "lycoris_c.weight": torch.randn(4, generator=g) * 0.1,
          "lycoris_c.on_input": torch.tensor(False),
          "lycoris_d.lora_down.weight": torch.randn(2, 8, generator=g),
          "lycoris_d.lora_up.weight": torch.randn(8, 2, generator=g),
          "lycoris_d.dora_scale": torch.rand(8, 1, generator=g) + 0.5,
          "lycoris_norm.w_norm": torch.randn(8, generator=g) * 0.1,
          "lycoris_norm.b_norm": torch.randn(8, generator=g) * 0.1}
    dyn, merged = model(), model()
    shuttle.merge_lora(merged, [(sd, 0.7)])
    x = torch.randn(3, 8, generator=g)

    def run(m):
        return m.c(m.b(m.a(x)) if False else torch.relu(m.b(m.a(x)))), m.d(x), m.norm(x)

    with shuttle.apply_lora(dyn, [(sd, 0.7)], mode="dynamic", quality="lossless") as h:
        assert len(h.applied) == 7
        for got, want in zip(run(dyn), run(merged), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_detach_restores_the_model_exactly():
    m = _linear_model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    sig = inspect.signature(m[0].forward)
    x = torch.randn(4, 32).bfloat16()
    y0 = m(x)
    g = torch.Generator().manual_seed(6)
    h = shuttle.attach_lora(m, [(_lora_sd("0", 48, 32, 4, g), 1.0)], quality="lossless")
    assert isinstance(m[0], nn.Linear) and type(m[0]) is nn.Linear
    assert inspect.signature(m[0].forward) == sig
    assert not torch.equal(m(x), y0)
    h.detach()
    assert "forward" not in m[0].__dict__ and not hooks_of(m[0])
    assert torch.equal(m(x), y0)
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_scoped_dynamic_detaches_when_the_body_raises():
    m = _linear_model()
    g = torch.Generator().manual_seed(7)
    with pytest.raises(RuntimeError, match="boom"), \
            shuttle.apply_lora(m, [(_lora_sd("0", 48, 32, 4, g), 1.0)], mode="dynamic"):
        raise RuntimeError("boom")
    assert not hooks_of(m[0])


def test_strength_and_request_scale():
    m = _linear_model(torch.float32)
    g = torch.Generator().manual_seed(8)
    sd = _lora_sd("0", 48, 32, 4, g, dtype=torch.float32, scale=0.5)
    x = torch.randn(3, 32, generator=g)
    base = m[0](x)
    delta = x @ sd["0.lora_A.weight"].T @ sd["0.lora_B.weight"].T
    h = shuttle.attach_lora(m, [(sd, 1.0)], quality="lossless")
    torch.testing.assert_close(m[0](x), base + delta)
    h.set_strength(0, 0.25)
    torch.testing.assert_close(m[0](x), base + 0.25 * delta)
    with shuttle.lora_scale(2.0):
        torch.testing.assert_close(m[0](x), base + 0.5 * delta)
    torch.testing.assert_close(m[0](x), base + 0.25 * delta)
    with pytest.raises(InvalidStrengthError):
        h.set_strength(0, float("nan"))
    with pytest.raises(InvalidStrengthError), shuttle.lora_scale(float("inf")):
        pass
    h.detach()


def test_bad_input_attaches_nothing():
    m = _linear_model()
    g = torch.Generator().manual_seed(9)
    bad = _lora_sd("0", 47, 32, 4, g)  # wrong output size
    with pytest.raises(ShapeMismatchError):
        shuttle.attach_lora(m, [(bad, 1.0)])
    with pytest.raises(InvalidStrengthError):
        shuttle.attach_lora(m, [(_lora_sd("0", 48, 32, 4, g), float("nan"))])
    assert not any(hooks_of(mod) for mod in m.modules())


def test_compiled_model_does_not_recompile_on_strength_scale_or_swap():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    m = _linear_model(torch.float32)
    g = torch.Generator().manual_seed(10)
    h = shuttle.attach_lora(m, [(_lora_sd("0", 48, 32, 4, g, dtype=torch.float32), 1.0)],
                            quality="lossless", max_rank=8)
    compiled = torch.compile(m, backend="eager")
    x = torch.randn(3, 32)
    compiled(x)
    frames = counters["stats"]["unique_graphs"]
    h.set_strength(0, 0.3)
    y1 = compiled(x)
    with shuttle.lora_scale(0.5):
        y2 = compiled(x)
    new = shuttle.load_lora(_lora_sd("0", 48, 32, 8, g, dtype=torch.float32))
    h.swap(0, new)
    y3 = compiled(x)
    assert counters["stats"]["unique_graphs"] == frames
    eager = [m(x) for _ in range(1)]
    torch.testing.assert_close(y3, eager[0])
    assert not torch.allclose(y1, y2)
    h.detach()


def test_conv_and_embedding_errors_no_worse_than_exact():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(11)
    m = nn.Module()
    m.conv = nn.Conv2d(4, 6, 3, padding=1).bfloat16()
    sd = {"conv.lora_down.weight": (torch.randn(3, 4, 3, 3, generator=g) * 0.3).bfloat16(),
          "conv.lora_up.weight": (torch.randn(6, 3, 1, 1, generator=g) * 0.3).bfloat16()}
    x = torch.randn(2, 4, 6, 6, generator=g).bfloat16()
    w = m.conv.weight.double() + 0.9 * (sd["conv.lora_up.weight"].double().flatten(1)
                                        @ sd["conv.lora_down.weight"].double().flatten(1)
                                        ).reshape(m.conv.weight.shape)
    ref = torch.nn.functional.conv2d(x.double(), w, m.conv.bias.double(), padding=1)
    errs = {}
    for q in ("exact", "lossless"):
        with shuttle.apply_lora(m, [(sd, 0.9)], mode="dynamic", quality=q):
            errs[q] = _error(m.conv(x), ref)
    assert errs["lossless"] <= errs["exact"] * 1.05 and errs["lossless"] < 2e-2


def test_a_patch_the_layer_cannot_take_names_the_layer():
    m = nn.Module()
    m.conv = nn.Conv2d(4, 6, 1)
    sd = {"conv.lora_down.weight": torch.randn(2, 4, 1, 1),
          "conv.lora_up.weight": torch.randn(3, 2, 1, 1)}
    with pytest.raises(shuttle.errors.UnsupportedLayerError, match="conv"):
        shuttle.attach_lora(m, [(sd, 1.0)], mapping={"conv": ("conv", (0, 3))})
    assert not hooks_of(m.conv)


@pytest.mark.gpu
def test_gpu_fused_layer_launches_from_checked_operands_and_follows_its_weight():
    from shuttle.kernels import lora_linear_fused, lora_shrink

    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(256, 384)).cuda().bfloat16()
    lin = model[0]
    sd = _lora_sd("0", 384, 256, 16, g, alpha=8.0)
    x = torch.randn(200, 256, generator=g).cuda().bfloat16()
    with torch.no_grad():
        handle = shuttle.attach_lora(model, [(sd, 0.7)], quality="fused")
        hook = hooks_of(lin)[0]
        hook.allow_cute = False  # Triton's kernels (the CuTe one: its own tests)

        def functions():  # the same layer by the unprepared kernel functions
            s = lora_shrink(x, hook.down, hook.scales(x.device))
            return lora_linear_fused(x, lin.weight, lin.bias, s, hook.up)

        got = model(x)
        prep = hook._prepared["fused"]
        assert prep.usable
        assert torch.equal(got, functions())
        lin.weight.data = lin.weight.data * 2  # a storage swap, as offloading does
        got = model(x)
        assert hook._prepared["fused"] is not prep and torch.equal(got, functions())
        handle.detach()


@pytest.mark.parametrize("quality", [pytest.param("lossless", marks=pytest.mark.gpu), "fused"])
def test_decode_runs_the_layers_prepared_kernels_and_follows_its_bias(quality, monkeypatch):
    # At a few tokens both tiers launch the decode kernels bound once for the layer's factors
    # (lossless's update: on CUDA; fused's whole layer: also under the interpreter), giving
    # bit for bit what the kernel functions give, which a later call never reaches.
    from shuttle.kernels import lora_decode, lora_decode_add, lora_decode_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 96)).to(device).bfloat16()
    lin = model[0]
    sd = _lora_sd("0", 96, 64, 16, g, alpha=8.0)
    x = torch.randn(2, 3, 64, generator=g).to(device).bfloat16()
    with torch.no_grad():
        handle = shuttle.attach_lora(model, [(sd, 0.7)], quality=quality)
        hook = hooks_of(lin)[0]

        def functions(bias):
            scale = hook.scales(x.device)
            if quality == "fused":
                return lora_decode_linear(x.view(6, 64), lin.weight, bias, hook.down, hook.up,
                                          scale).view(2, 3, 96)
            out = torch.nn.functional.linear(x, lin.weight, bias)
            return lora_decode_add(out.view(6, 96), x.view(6, 64), hook.down, hook.up,
                                   scale).view(2, 3, 96)

        want = functions(lin.bias)
        assert torch.equal(model(x), want)
        for name in ("lora_decode_add", "lora_decode_linear"):
            monkeypatch.setattr(lora_decode, name, lambda *a, **kw: pytest.fail("unbound"))
        assert torch.equal(model(x), want)
        lin.bias = None  # the fused output kernel bound again, without a bias
        monkeypatch.undo()
        want = functions(None)
        assert torch.equal(model(x), want)
        handle.detach()


@pytest.mark.gpu
@pytest.mark.parametrize("quality", ["fused", "auto"])
def test_gpu_fused_layer_takes_a_transposed_input_by_its_prepared_path(quality, monkeypatch):
    # A residual stream kept transposed ((B, K, T) viewed as (B, T, K): features strided) is
    # copied once and runs the prepared kernels, as a contiguous x does, bit for bit.
    import shuttle.apply.dynamic_layer as dynamic_layer
    from shuttle.apply.tier import TIERS

    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 384)).cuda().bfloat16()
    sd = _lora_sd("0", 384, 256, 16, g, alpha=8.0)
    x = torch.randn(1, 256, 300, generator=g).cuda().bfloat16().transpose(1, 2)
    assert x.stride(-1) != 1
    with torch.no_grad():
        handle = shuttle.attach_lora(model, [(sd, 0.7)], quality="fused")
        hooks_of(model[0])[0].allow_cute = False  # Triton's kernels on both sides
        want = model(x.contiguous())
        handle.detach()
        TIERS.clear()
        handle = shuttle.attach_lora(model, [(sd, 0.7)], quality=quality)
        hooks_of(model[0])[0].allow_cute = False

        def unprepared(*args, **kwargs):
            raise AssertionError("a strided x left the prepared path")

        monkeypatch.setattr(dynamic_layer, "lora_linear_fused", unprepared)
        got = model(x)
        if quality == "auto":  # the chooser measured the fused candidate (none was dropped)
            (choice,) = TIERS.choices.values()
            assert "fused" in choice.graphs and "fused" in choice.eager
            got = hooks_of(model[0])[0]._fused(model[0], x, {}, "fused")
        assert torch.equal(got, want)
        handle.detach()
        TIERS.clear()


def _flux_model(layout: str, h: int, mlp: int, inp: int) -> nn.Module:
    """A one-block Flux skeleton (float32): BFL's fused ``img_attn.qkv`` and ``linear1``, or
    diffusers' separate ``to_q/to_k/to_v`` and ``proj_mlp`` (what the Flux name table needs)."""
    torch.manual_seed(0)
    m = nn.Module()
    if layout == "bfl":
        m.double_blocks = nn.ModuleList([nn.Module()])
        m.double_blocks[0].img_attn = nn.Module()
        m.double_blocks[0].img_attn.qkv = nn.Linear(inp, 3 * h)
        m.single_blocks = nn.ModuleList([nn.Module()])
        m.single_blocks[0].linear1 = nn.Linear(inp, 3 * h + mlp)
    else:
        m.transformer_blocks = nn.ModuleList([nn.Module()])
        m.transformer_blocks[0].attn = nn.Module()
        for n in ("to_q", "to_k", "to_v"):
            setattr(m.transformer_blocks[0].attn, n, nn.Linear(inp, h))
        m.single_transformer_blocks = nn.ModuleList([nn.Module()])
        m.single_transformer_blocks[0].proj_mlp = nn.Linear(inp, mlp)
    return m


def _flux_qkv_outputs(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(m, "double_blocks"):
        return m.double_blocks[0].img_attn.qkv(x)
    attn = m.transformer_blocks[0].attn
    return torch.cat([attn.to_q(x), attn.to_k(x), attn.to_v(x)], dim=-1)


@pytest.mark.parametrize("quality", ["lossless", "fused"])
@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_kohya_flux_split_qkv_dynamic_equals_merged(layout, quality):
    """A kohya split-qkv save (downs stacked, ups block diagonal, alpha of one split) keeps its
    n-times scale (``effective_scale``) at forward time: dynamic output == merged output, on
    the fused qkv weight and split over diffusers' to_q/to_k/to_v."""
    h, mlp, inp, r = 8, 16, 6, 2
    g = torch.Generator().manual_seed(12)
    key = "lora_unet_double_blocks_0_img_attn_qkv"
    sd = {f"{key}.lora_up.weight": torch.block_diag(
              *[torch.randn(h, r, generator=g) * 0.5 for _ in range(3)]),
          f"{key}.lora_down.weight": torch.randn(3 * r, inp, generator=g) * 0.5,
          f"{key}.alpha": torch.tensor(4.0)}
    lora = shuttle.load_lora(sd)
    (patch,) = lora.modules[key]
    assert patch.split_qkv and patch.effective_scale == 3 * patch.scale  # the case under test
    merged = _flux_model(layout, h, mlp, inp)
    report = shuttle.merge_lora(merged, [(lora, 0.8)])
    assert len(report.applied) == (1 if layout == "bfl" else 3) and not report.unmatched
    dyn = _flux_model(layout, h, mlp, inp)
    x = torch.randn(5, inp, generator=g)
    with torch.no_grad():
        base = _flux_qkv_outputs(dyn, x)
        want = _flux_qkv_outputs(merged, x)
        with shuttle.apply_lora(dyn, [(lora, 0.8)], mode="dynamic", quality=quality):
            got = _flux_qkv_outputs(dyn, x)
    assert not torch.allclose(want, base, rtol=1e-2, atol=1e-2)  # the update is not negligible
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _dense_kind_sd(kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """An adapter of one residual-path kind for ``lin`` = Linear(8, 6)."""
    sds = {
        "diff": {"lycoris_lin.diff": torch.randn(6, 8, generator=g),
                 "lycoris_lin.diff_b": torch.randn(6, generator=g)},
        "loha": {"lycoris_lin.hada_w1_a": torch.randn(6, 2, generator=g),
                 "lycoris_lin.hada_w1_b": torch.randn(2, 8, generator=g),
                 "lycoris_lin.hada_w2_a": torch.randn(6, 2, generator=g),
                 "lycoris_lin.hada_w2_b": torch.randn(2, 8, generator=g),
                 "lycoris_lin.alpha": torch.tensor(1.0)},
        "lokr": {"lycoris_lin.lokr_w1": torch.randn(2, 2, generator=g),
                 "lycoris_lin.lokr_w2": torch.randn(3, 4, generator=g)},
        "dora": {"lycoris_lin.lora_down.weight": torch.randn(2, 8, generator=g),
                 "lycoris_lin.lora_up.weight": torch.randn(6, 2, generator=g),
                 "lycoris_lin.dora_scale": torch.rand(6, 1, generator=g) + 0.5},
        "ia3": {"lycoris_lin.weight": torch.randn(6, generator=g) * 0.1,
                "lycoris_lin.on_input": torch.tensor(False)},
        "set": {"lin.set_weight": torch.randn(6, 8, generator=g)},
    }
    return sds[kind]


@pytest.mark.parametrize("kind", ["diff", "loha", "lokr", "dora", "ia3", "set"])
def test_set_strength_equals_attaching_at_the_new_strength(kind):
    """set_strength refreshes the float32 weight residual of every non-low-rank kind: the
    output is bit-identical to attaching the adapter at the new strength from scratch."""
    g = torch.Generator().manual_seed(13)
    sd = _dense_kind_sd(kind, g)

    def model() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Module()
        m.lin = nn.Linear(8, 6)
        return m

    x = torch.randn(3, 8, generator=g)
    changed, fresh = model(), model()
    with torch.no_grad():
        handle = shuttle.attach_lora(changed, [(sd, 0.7)], quality="lossless")
        assert handle.applied and all(not h.slots and h.dense for h in handle.hooks.values())
        before = changed.lin(x)
        handle.set_strength(0, -0.4)
        got = changed.lin(x)
        handle.detach()
        with shuttle.apply_lora(fresh, [(sd, -0.4)], mode="dynamic", quality="lossless"):
            want = fresh.lin(x)
    assert torch.equal(got, want), (
        f"after set_strength the output differs from a fresh attach at the new strength by up "
        f"to {float((got - want).abs().max()):.3g}")
    assert not torch.equal(want, before)  # the new strength changes the output


def _split_qkv_sd(seed: int, rank: int = 4, dim: int = 16) -> dict[str, torch.Tensor]:
    """A PEFT-style adapter with separate q/k/v keys (float32)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n in ("to_q", "to_k", "to_v"):
        sd |= _lora_sd(n, dim, dim, rank, g, dtype=torch.float32, scale=0.5)
    return sd


def _native_qkv(dtype=torch.float32) -> nn.Module:
    """A model with one native fused ``to_qkv`` Linear: q/k/v keys land on its rows."""
    torch.manual_seed(0)
    m = nn.Module()
    m.to_qkv = nn.Linear(16, 48).to(dtype)
    m.out = nn.Linear(48, 16).to(dtype)
    return m


@pytest.mark.parametrize("quality", ["exact", "lossless", "fused"])
def test_swap_on_fused_rows_equals_a_fresh_attach(quality):
    """Three slots (q, k, v rows) on one fused weight: swap replaces each on its own rows, so
    the output is the fresh attach's bit for bit (before the fix only the first slot took the
    new factors, the last key's: off by several units)."""
    old, new = shuttle.load_lora(_split_qkv_sd(1)), shuttle.load_lora(_split_qkv_sd(2))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    swapped, fresh = _native_qkv(), _native_qkv()
    with torch.no_grad():
        handle = shuttle.attach_lora(swapped, [(old, 0.7)], quality=quality)
        assert [s.rows for s in hooks_of(swapped.to_qkv)[0].slots] == [(0, 16), (16, 32),
                                                                        (32, 48)]
        before = swapped.to_qkv(x)
        report = handle.swap(0, new)
        got = swapped.to_qkv(x)
        handle.detach()
        with shuttle.apply_lora(fresh, [(new, 0.7)], mode="dynamic", quality=quality):
            want = fresh.to_qkv(x)
    assert report.applied == ["to_qkv.weight"] and not report.unmatched
    assert torch.equal(got, want), f"off by {float((got - want).abs().max()):.3g}"
    assert not torch.allclose(before, want)
    assert handle.loras[0] is new


def test_swap_after_fuse_qkv_projections_equals_a_fresh_attach():
    """diffusers' fused Flux: each split key has a slot on its split layer and one on its rows
    of ``to_qkv``; swap replaces both."""
    pytest.importorskip("diffusers")
    from diffusers import FluxTransformer2DModel

    def flux():
        torch.manual_seed(0)
        m = FluxTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()
        m.fuse_qkv_projections()
        return m

    def lora(seed):
        g = torch.Generator().manual_seed(seed)
        sd = {}
        for n in ("to_q", "to_k", "to_v"):
            sd |= _lora_sd(f"transformer.transformer_blocks.0.attn.{n}", 32, 32, 4, g,
                           dtype=torch.float32, scale=0.3)
        return shuttle.load_lora(sd)

    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 4, generator=g),
              "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
              "pooled_projections": torch.randn(1, 32, generator=g),
              "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3),
              "txt_ids": torch.zeros(8, 3)}
    swapped, fresh = flux(), flux()
    with torch.no_grad():
        handle = shuttle.attach_lora(swapped, [(lora(2), 0.8)])
        handle.swap(0, lora(3))
        got = swapped(**inputs).sample
        handle.detach()
        with shuttle.apply_lora(fresh, [(lora(3), 0.8)], mode="dynamic"):
            want = fresh(**inputs).sample
    assert torch.equal(got, want), f"off by {float((got - want).abs().max()):.3g}"


def _outputs(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m.out(m.to_qkv(x))


@pytest.mark.parametrize("case", ["other rows", "rank above a later slot", "dense kind",
                                  "non-finite"])
def test_swap_that_cannot_be_done_changes_nothing(case):
    """Every check runs before the first slot changes: the attached adapter stays."""
    m = _native_qkv()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(5)
    handle = shuttle.attach_lora(m, [(_split_qkv_sd(1) | _lora_sd("out", 16, 48, 4, g), 1.0)])
    before = _outputs(m, x)
    new = _split_qkv_sd(2) | _lora_sd("out", 16, 48, 4, g)
    if case == "other rows":  # q and k only: the v slot would keep the old factors
        new = {k: v for k, v in new.items() if not k.startswith("to_v")}
        err, match = shuttle.errors.UnsupportedLayerError, "same targets.*to_qkv rows"
    elif case == "rank above a later slot":  # to_qkv's slots fit, out's does not
        new |= _lora_sd("out", 16, 48, 6, g)
        err, match = shuttle.errors.UnsupportedLayerError, "out: .*max_rank >= 6"
    elif case == "dense kind":
        new["to_v.diff_b"] = torch.randn(16)
        err, match = shuttle.errors.UnsupportedLayerError, "low-rank weight patches only"
    else:
        new["to_v.lora_B.weight"][0, 0] = float("nan")
        err, match = shuttle.errors.NonFiniteAdapterError, "to_v"
    with pytest.raises(err, match=match):
        handle.swap(0, new)
    assert torch.equal(_outputs(m, x), before)
    handle.detach()


def test_swap_of_an_adapter_running_as_a_residual_is_refused():
    m = nn.Module()
    m.lin = nn.Linear(8, 6)
    g = torch.Generator().manual_seed(5)
    handle = shuttle.attach_lora(m, [(_dense_kind_sd("loha", g), 1.0)])
    with pytest.raises(shuttle.errors.UnsupportedLayerError, match="detach\\(\\) and attach"):
        handle.swap(0, _lora_sd("lin", 6, 8, 2, g, dtype=torch.float32))
    handle.detach()


@pytest.mark.parametrize("quality", ["exact", "lossless"])
def test_swap_on_conv_and_embedding_equals_a_fresh_attach(quality):
    def model():
        torch.manual_seed(0)
        m = nn.Module()
        m.conv = nn.Conv2d(3, 8, 3, padding=1)
        m.emb = nn.Embedding(20, 6)
        return m

    def sd(seed):
        g = torch.Generator().manual_seed(seed)
        return {"conv.lora_down.weight": torch.randn(2, 3, 3, 3, generator=g) * 0.2,
                "conv.lora_up.weight": torch.randn(8, 2, 1, 1, generator=g) * 0.2,
                "base_model.model.emb.lora_embedding_A": torch.randn(3, 20, generator=g),
                "base_model.model.emb.lora_embedding_B": torch.randn(6, 3, generator=g)}

    x = torch.randn(2, 3, 5, 5)
    ids = torch.tensor([[1, 4, 19], [0, 2, 2]])
    swapped, fresh = model(), model()
    with torch.no_grad():
        handle = shuttle.attach_lora(swapped, [(sd(1), 0.6)], quality=quality)
        handle.swap(0, sd(2))
        got = (swapped.conv(x), swapped.emb(ids))
        handle.detach()
        with shuttle.apply_lora(fresh, [(sd(2), 0.6)], mode="dynamic", quality=quality):
            want = (fresh.conv(x), fresh.emb(ids))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _two_adapters():
    g = torch.Generator().manual_seed(21)
    return _lora_sd("0", 48, 32, 4, g), _lora_sd("0", 48, 32, 6, g)


@pytest.mark.parametrize("quality", ["exact", "lossless"])
def test_adapters_by_name(quality):
    m = _linear_model()
    a, b = _two_adapters()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(22)).bfloat16()
    base = m(x)
    with shuttle.apply_lora(m, [(b, 0.5)], mode="dynamic", quality=quality):
        b_alone = m(x)
    with shuttle.apply_lora(m, [(a, 0.3), (b, 0.5)], mode="dynamic", quality=quality):
        both = m(x)
    h = shuttle.attach_lora(m, [(a, 0.3), (b, 0.5)], quality=quality, names=["a", "b"])
    assert h.names == ["a", "b"] and h.active == {"a": 0.3, "b": 0.5}
    assert torch.equal(m(x), both)
    h.set_adapters({"b": 0.5})  # diffusers' set_adapters: the others off
    assert h.active == {"b": 0.5}
    torch.testing.assert_close(m(x), b_alone, rtol=0, atol=0)
    h.set_strength("a", 0.3)
    assert torch.equal(m(x), both)
    with pytest.raises(AdapterIndexError, match=r"\['a', 'b'\]"):
        h.set_strength("c", 1.0)
    h.delete("a")
    assert h.names == ["b"] and len(h.loras) == 1
    assert torch.equal(m(x), b_alone)
    h.detach()
    assert torch.equal(m(x), base)


def test_default_names_come_from_the_files(tmp_path):
    from safetensors.torch import save_file

    a, b = _two_adapters()
    save_file(a, str(tmp_path / "style.safetensors"))
    h = shuttle.attach_lora(_linear_model(), [(str(tmp_path / "style.safetensors"), 1.0),
                                              (str(tmp_path / "style.safetensors"), 0.5),
                                              (b, 0.2)])
    assert h.names == ["style", "style_2", "adapter2"]
    h.detach()
    with pytest.raises(AdapterIndexError, match="one distinct string per adapter"):
        shuttle.attach_lora(_linear_model(), [(a, 1.0), (b, 1.0)], names=["x", "x"])


@pytest.mark.gpu
@pytest.mark.parametrize("quality", ["lossless", "fused", "auto"])
@pytest.mark.parametrize("tokens", [4, 200])  # the decode kernels, and the prefill path
def test_gpu_cuda_graph_captured_warm_follows_strength_and_request_scale(quality, tokens,
                                                                        monkeypatch):
    # Captured after eager calls have cached the combined scales: replays must still read the
    # tensors that set_strength and lora_scale update, not the vector cached before capture
    # (under "auto" the capture is detected once per call, by the tier's dispatch).
    if quality == "auto":
        from shuttle.apply import dynamic_layer
        from shuttle.apply.tier import TierChoice, TierChooser

        class FusedFastest(TierChooser):  # one pick eagerly and in graphs: outputs compare
            def choose(self, key, candidates, *, graphs=False):
                times = {name: 1.0 if name == "fused" else 2.0 for name in candidates}
                self.choices[key] = TierChoice(times, times, times, times)
                return self.choices[key].best(graphs)

        monkeypatch.setattr(dynamic_layer, "TIERS", FusedFastest())
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 384)).cuda().bfloat16()
    sd = _lora_sd("0", 384, 256, 16, g, alpha=8.0)
    x = torch.randn(tokens, 256, generator=g).cuda().bfloat16()
    with torch.no_grad():
        handle = shuttle.attach_lora(model, [(sd, 0.7)], quality=quality)
        for _ in range(3):  # warm: kernels compiled, scale vector cached
            model(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model(x)

        def replay():
            graph.replay()
            torch.cuda.synchronize()
            return static_out.clone()

        assert torch.equal(replay(), model(x))
        handle.set_strength(0, 0.2)
        eager = model(x)
        got = replay()
        assert torch.equal(got, eager)
        with shuttle.lora_scale(0.5):
            eager_half = model(x)
            got_half = replay()
        assert torch.equal(got_half, eager_half) and not torch.equal(got_half, got)
        handle.detach()


class _CausalConv3d(nn.Conv3d):
    """Pads its input itself (as video VAEs' causal convolutions do), then convolves."""

    def forward(self, x):
        return super().forward(nn.functional.pad(x, (1, 1, 1, 1, 2, 0)))


@pytest.mark.parametrize("make", [
    lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"),
    lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="circular"),
    lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2),
    lambda: _CausalConv3d(4, 6, 3),
], ids=["reflect", "circular", "groups", "causal3d"])
@pytest.mark.parametrize("quality", ["exact", "lossless"])
def test_convolutions_the_factors_cannot_run_take_the_weight_residual(make, quality):
    # The low-rank conv residual convolves x with zero padding and one group: any other layer
    # runs its own forward over W + R, and equals the merged layer.
    from shuttle.apply.layer_kind import layer_kind

    torch.manual_seed(0)
    m = nn.Sequential(make())
    conv = m[0]
    w = conv.weight
    sd = {"0.lora_down.weight": torch.randn(2, *w.shape[1:]) * 0.3,
          "0.lora_up.weight": torch.randn(w.shape[0], 2, *[1] * (w.dim() - 2)) * 0.3}
    x = torch.randn(1, 4, *([5] * (w.dim() - 2)))
    with torch.no_grad():
        with shuttle.apply_lora(m, [(sd, 0.9)], mode="dynamic", quality=quality) as h:
            got = m(x)
            hook = hooks_of(conv)[0]
            assert layer_kind(conv).name == "conv" and not hook.slots and hook.residuals
            del h
        with shuttle.apply_lora(m, [(sd, 0.9)], mode="merge"):
            merged = m(x)
    torch.testing.assert_close(got, merged, rtol=1e-5, atol=1e-5)


def test_a_registered_layer_kind_runs_its_patches_as_residuals():
    from shuttle.apply.layer_kind import LAYER_KINDS, LayerKind, layer_kind, register_layer_kind

    class Projection(nn.Module):  # a Linear-shaped layer of a class torch does not know
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 4))

        def forward(self, x):
            return x @ self.weight.T

    torch.manual_seed(0)
    m = nn.Sequential(Projection())
    sd = {"0.lora_A.weight": torch.randn(2, 4), "0.lora_B.weight": torch.randn(6, 2)}
    x = torch.randn(3, 4)
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 1.0)], mode="merge"):
        merged = m(x)
    assert layer_kind(m[0]).name == "other"
    try:
        register_layer_kind(Projection)(LayerKind("projection", lambda mod, p: True,
                                                  tiers=True))
        with torch.no_grad(), shuttle.apply_lora(m, [(sd, 1.0)], mode="dynamic",
                                                 quality="lossless"):
            hook = hooks_of(m[0])[0]
            assert len(hook.slots) == 1 and not hook.residuals
            got = m(x)
    finally:
        LAYER_KINDS.pop(Projection, None)
    torch.testing.assert_close(got, merged)


def test_a_followed_scale_vector_is_rewritten_in_place_by_strength_and_scale_changes():
    # What a captured CUDA graph reads: the layer's own vector, updated in place (same object)
    # by set_strength and by the shared request scale, never replaced.
    from shuttle.apply.scale import follow

    g = torch.Generator().manual_seed(12)
    model = nn.Sequential(nn.Linear(32, 48))
    handle = shuttle.attach_lora(model, [(_lora_sd("0", 48, 32, 4, g, dtype=torch.float32),
                                          1.0)], quality="lossless")
    hook = hooks_of(model[0])[0]
    with torch.no_grad():
        model(torch.randn(2, 32))
    vec = hook.scales._graph_scale
    base = vec.clone()
    follow(handle.strengths, hook.scales)
    assert handle.strengths.following(hook.scales)
    handle.set_strength(0, 0.5)
    assert hook.scales._graph_scale is vec and torch.allclose(vec, base * 0.5)
    with shuttle.lora_scale(0.25):
        assert torch.allclose(vec, base * 0.125)
    assert torch.allclose(vec, base * 0.5)
    handle.detach()


def _loha_sd(prefix, out_f, in_f, g):
    return {f"{prefix}.hada_w1_a": torch.randn(out_f, 2, generator=g) * 0.1,
            f"{prefix}.hada_w1_b": torch.randn(2, in_f, generator=g) * 0.1,
            f"{prefix}.hada_w2_a": torch.randn(out_f, 2, generator=g) * 0.1,
            f"{prefix}.hada_w2_b": torch.randn(2, in_f, generator=g) * 0.1}


def _second_adapter(kind, g):
    """An adapter on ``0.weight`` (48, 32): low-rank (the Linear tiers), LoHa (the weight
    residual), or a kind whose patch at strength 0 is not the identity (PEFT DoRA renormalizes
    W, set_weight gives 0 * value): at 0 each must be off all the same."""
    if kind == "lowrank":
        return _lora_sd("0", 48, 32, 6, g, dtype=torch.float32)
    if kind == "loha":
        return _loha_sd("lycoris_0", 48, 32, g)
    if kind == "dora":
        return {"base_model.model.0.lora_A.weight": torch.randn(2, 32, generator=g) * 0.1,
                "base_model.model.0.lora_B.weight": torch.randn(48, 2, generator=g) * 0.1,
                "base_model.model.0.lora_magnitude_vector": torch.rand(48, generator=g) + 0.5}
    return {"0.set_weight": torch.randn(48, 32, generator=g) * 0.1}


@pytest.mark.parametrize("quality", ["exact", "lossless"])
@pytest.mark.parametrize("kind", ["lowrank", "loha", "dora", "set"])
def test_an_adapter_attached_at_zero_keeps_its_name_and_comes_back(quality, kind):
    m = _linear_model(torch.float32)
    g = torch.Generator().manual_seed(23)
    a = _lora_sd("0", 48, 32, 4, g, dtype=torch.float32)
    b = _second_adapter(kind, g)
    x = torch.randn(5, 32, generator=g)
    same = torch.equal if quality == "exact" else torch.allclose

    def alone(*loras):
        with torch.no_grad(), shuttle.apply_lora(m, list(loras), mode="dynamic",
                                                 quality=quality):
            return m(x)

    a_only, both, b_only = alone((a, 0.3)), alone((a, 0.3), (b, 0.5)), alone((b, 0.5))
    h = shuttle.attach_lora(m, [(a, 0.3), (b, 0.0)], quality=quality, names=["a", "b"])
    assert h.names == ["a", "b"] and list(h.strengths) == [0.3, 0.0] and h.active == {"a": 0.3}
    assert same(m(x), a_only)
    h.set_strength("b", 0.5)
    assert same(m(x), both)
    h.set_adapters({"b": 0.5})
    assert h.active == {"b": 0.5} and same(m(x), b_only)
    h.set_strength("b", 0)  # set back to 0: off again, whatever the patch does at 0
    assert h.active == {} and torch.equal(m(x), alone())
    h.detach()
    with shuttle.apply_lora(m, [(a, 0), (b, 0.5)], mode="dynamic", quality=quality,
                            names=["a", "b"]) as h:
        assert h.names == ["a", "b"] and same(m(x), b_only)
        h.set_adapters(["a", "b"], [0.3, 0.5])
        assert same(m(x), both)
    with pytest.raises(InvalidOptionError, match="names are for the handle of mode='dynamic'"), \
            shuttle.apply_lora(m, [(a, 0.3)], mode="merge", names=["a"]):
        pass
    assert torch.equal(m(x), alone())


def _named_pair(names=("a", "b")):
    m = _linear_model(torch.float32)
    g = torch.Generator().manual_seed(24)
    a, b = (_lora_sd("0", 48, 32, r, g, dtype=torch.float32) for r in (4, 6))
    return m, shuttle.attach_lora(m, [(a, 0.3), (b, 0.5)], names=names)


def test_set_adapters_takes_diffusers_spellings():
    m, h = _named_pair(("style", "detail"))
    for args, want in [((["style", "detail"], [0.7, 0.2]), [0.7, 0.2]),  # a weight per name
                       (("detail", 0.4), [0.0, 0.4]),                     # one name, one weight
                       ((["style", "detail"], 0.6), [0.6, 0.6]),          # one for every name
                       ((["detail"],), [0.0, 1.0]),                       # no weights: 1 each
                       (((1, "style"), (0.9, 0.1)), [0.1, 0.9]),          # indices, tuples
                       ((0,), [1.0, 0.0]),
                       (("style",), [1.0, 0.0]),                          # one name alone
                       (({"style": 0.25},), [0.25, 0.0])]:
        h.set_adapters(*args)
        assert list(h.strengths) == want, args
    h.detach()


@pytest.mark.parametrize(("args", "error", "match"), [
    (({"a": 0.7, "b": float("nan")},), InvalidStrengthError, "strength of 'b' is nan"),
    ((["a", "b"], [0.7, float("inf")]), InvalidStrengthError, "strength of 'b'"),
    ((["a", "b"], [0.7]), InvalidStrengthError, "2 name.* and 1 weight"),
    ((["a"], [0.7, 0.2]), InvalidStrengthError, "1 name.* and 2 weight"),
    ((["a", "c"], [0.7, 0.2]), AdapterIndexError, r"'c'.*\['a', 'b'\]"),
    ((["a", 0], [0.7, 0.2]), AdapterIndexError, "named twice"),
    (({"a": 0.7}, [0.2]), InvalidStrengthError, "mapping carries its strengths"),
    ((["a"], "0.7"), InvalidStrengthError, "real number"),
    (({"a", "b"}, 0.7), AdapterIndexError, "a list of names"),
])
def test_set_adapters_checks_every_name_and_strength_before_changing_one(args, error, match):
    m, h = _named_pair()
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(25))
    with torch.no_grad():
        before = m(x)
    with pytest.raises(error, match=match):
        h.set_adapters(*args)
    assert list(h.strengths) == [0.3, 0.5]
    assert torch.equal(h.strength_tensor(x.device), torch.tensor([0.3, 0.5]))
    with torch.no_grad():
        assert torch.equal(m(x), before)
    h.detach()
