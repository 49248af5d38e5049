"""merge_lora and apply_lora against float64 reference math written here.

Inputs are drawn from dyadic grids (small integers over a power of two) so that every float32
intermediate shuttle computes is exact: the float64 reference ``W + sum_i m_i * s_i * delta_i``
rounded once to the weight's dtype must then equal shuttle's result bit for bit, for any order
of accumulation. The sums still need more significand bits than bfloat16/float16 hold, so the
final rounding is exercised (each test checks that it changed some values).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.formats.safetensors_file import SafetensorsFile
from tests import assert_bits_equal, assert_unchanged, snapshot

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# -- helpers --------------------------------------------------------------------------------------

def grid(*shape: int, g: torch.Generator, k: int = 8, denom: int = 32) -> torch.Tensor:
    """float64 values j/denom, |j| <= k: exact in float32, bfloat16 and float16."""
    return torch.randint(-k, k + 1, shape, generator=g).double() / denom


def set_weights(model: nn.Module, g: torch.Generator) -> None:
    """Weights j/64, |j| <= 128: representable in every tested dtype."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(grid(*p.shape, g=g, k=128, denom=64))


def rounding_matters(ref: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool((ref.to(dtype).double() != ref).any())


# -- one layer of each kind ----------------------------------------------------------------------

def _linear_case(dtype, g):
    model = nn.Linear(16, 8, bias=False).to(dtype)
    up, down = grid(8, 4, g=g), grid(4, 16, g=g)
    sd = {"lora_unet_layer.lora_up.weight": up.float(),
          "lora_unet_layer.lora_down.weight": down.float(),
          "lora_unet_layer.alpha": torch.tensor(2.0)}
    return model, sd, "weight", (up @ down) * (2.0 / 4)


def _conv_case(dtype, g):
    model = nn.Conv2d(4, 6, 3, bias=False).to(dtype)
    up, down = grid(6, 4, 1, 1, g=g), grid(4, 4, 3, 3, g=g)
    sd = {"lora_unet_layer.lora_up.weight": up.float(),
          "lora_unet_layer.lora_down.weight": down.float(),
          "lora_unet_layer.alpha": torch.tensor(1.0)}
    # kohya's LoCon merge: the delta is a convolution of down (as input) by up (as kernel).
    delta = torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
    return model, sd, "weight", delta * (1.0 / 4)


def _embedding_case(dtype, g):
    model = nn.Embedding(10, 6).to(dtype)
    a, b = grid(3, 10, g=g), grid(6, 3, g=g)  # PEFT: A (r, vocab), B (dim, r)
    sd = {"base_model.model.layer.lora_embedding_A": a.float(),
          "base_model.model.layer.lora_embedding_B": b.bfloat16()}
    return model, sd, "weight", (b @ a).T


class Holder(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [_linear_case, _conv_case, _embedding_case],
                         ids=["linear", "conv2d", "embedding"])
def test_single_adapter_equals_float64_reference(case, dtype):
    g = torch.Generator().manual_seed(1)
    layer, sd, leaf, delta = case(dtype, g)
    model = Holder(layer)
    set_weights(model, g)
    w0 = getattr(layer, leaf).detach().double()
    strength = 0.75

    report = shuttle.merge_lora(model, [(sd, strength)])

    ref = w0 + strength * delta
    assert report.applied == [f"layer.{leaf}"]
    assert report.unmatched == {}
    assert_bits_equal(getattr(layer, leaf), ref.to(dtype))
    if dtype != torch.float32:
        assert rounding_matters(ref, dtype)


def test_strength_as_one_element_tensor_and_lora_object():
    g = torch.Generator().manual_seed(2)
    layer, sd, leaf, delta = _linear_case(torch.bfloat16, g)
    model = Holder(layer)
    set_weights(model, g)
    w0 = layer.weight.detach().double()
    lora = shuttle.load_lora(sd)
    shuttle.merge_lora(model, [(lora, torch.tensor(-1.25))])
    assert_bits_equal(layer.weight, (w0 - 1.25 * delta).to(torch.bfloat16))


# -- one rounding ---------------------------------------------------------------------------------

def _tiny_step_adapter(n_out: int, n_in: int, value: float) -> dict[str, torch.Tensor]:
    return {"layer.lora_A.weight": torch.full((1, n_in), value),
            "layer.lora_B.weight": torch.ones(n_out, 1)}


def test_one_rounding_two_sub_half_ulp_updates_add_up():
    """Each update is 3/8 of a bfloat16 step at 1.0: rounded on its own it vanishes, summed
    first it moves the weight by one step."""
    model = Holder(nn.Linear(4, 2, bias=False).to(torch.bfloat16))
    with torch.no_grad():
        model.layer.weight.fill_(1.0)
    step = 2.0**-7  # bfloat16 spacing in [1, 2)
    a1 = _tiny_step_adapter(2, 4, 0.375 * step)
    a2 = _tiny_step_adapter(2, 4, 0.375 * step)

    per_adapter = model.layer.weight.detach().clone()
    for _ in range(2):
        per_adapter = (per_adapter.double() + 0.375 * step).to(torch.bfloat16)
    single = (torch.ones(2, 4, dtype=torch.float64) + 0.75 * step).to(torch.bfloat16)
    assert torch.equal(per_adapter, torch.ones(2, 4, dtype=torch.bfloat16))
    assert torch.equal(single, torch.full((2, 4), 1.0 + step, dtype=torch.bfloat16))

    shuttle.merge_lora(model, [(a1, 1.0), (a2, 1.0)])
    assert_bits_equal(model.layer.weight, single)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_rounding_random_grid_differs_from_per_adapter_rounding(dtype):
    g = torch.Generator().manual_seed(3)
    model = Holder(nn.Linear(32, 16, bias=False).to(dtype))
    set_weights(model, g)
    w0 = model.layer.weight.detach().double()
    adapters, deltas = [], []
    for i, strength in enumerate((0.625, -0.375, 1.5)):
        a, b = grid(4, 32, g=g, denom=64), grid(16, 4, g=g, denom=64)
        adapters.append(({"layer.lora_A.weight": a.float(), "layer.lora_B.weight": b.float(),
                          "layer.alpha": torch.tensor(float(i + 1))}, strength))
        deltas.append(strength * (i + 1) / 4 * (b @ a))

    shuttle.merge_lora(model, adapters)

    single = (w0 + sum(deltas)).to(dtype)
    per_adapter = w0.to(dtype)
    for d in deltas:
        per_adapter = (per_adapter.double() + d).to(dtype)
    assert not torch.equal(per_adapter, single), "the inputs should show double rounding"
    assert_bits_equal(model.layer.weight, single)


# -- several adapters and kinds on one weight ----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_several_kinds_on_one_weight(dtype):
    """kohya LoRA + full diff (one adapter), LyCORIS LoHa, LyCORIS LoKr and a PEFT-style
    LoRA, all on ``layer.weight`` (8, 16); the diff_b also updates the bias."""
    g = torch.Generator().manual_seed(4)
    model = Holder(nn.Linear(16, 8).to(dtype))
    set_weights(model, g)
    w0 = model.layer.weight.detach().double()
    b0 = model.layer.bias.detach().double()

    up, down, diff, diff_b = grid(8, 2, g=g), grid(2, 16, g=g), grid(8, 16, g=g), grid(8, g=g)
    kohya = {"lora_unet_layer.lora_up.weight": up.float(),
             "lora_unet_layer.lora_down.weight": down.float(),
             "lora_unet_layer.alpha": torch.tensor(1.0),
             "lora_unet_layer.diff": diff.float(), "lora_unet_layer.diff_b": diff_b.float()}
    d_kohya = up @ down * 0.5 + diff

    w1a, w1b, w2a, w2b = (grid(8, 2, g=g, k=4, denom=4), grid(2, 16, g=g, k=4, denom=4),
                          grid(8, 2, g=g, k=4, denom=4), grid(2, 16, g=g, k=4, denom=4))
    loha = {"lycoris_layer.hada_w1_a": w1a.float(), "lycoris_layer.hada_w1_b": w1b.float(),
            "lycoris_layer.hada_w2_a": w2a.float(), "lycoris_layer.hada_w2_b": w2b.float(),
            "lycoris_layer.alpha": torch.tensor(1.0)}
    d_loha = (w1a @ w1b) * (w2a @ w2b) * 0.5

    k1, k2a, k2b = grid(2, 4, g=g), grid(4, 2, g=g), grid(2, 4, g=g)
    lokr = {"lycoris_layer.lokr_w1": k1.float(), "lycoris_layer.lokr_w2_a": k2a.float(),
            "lycoris_layer.lokr_w2_b": k2b.float(), "lycoris_layer.alpha": torch.tensor(4.0)}
    d_lokr = torch.kron(k1, k2a @ k2b) * 2.0  # scale alpha / rank(w2_b) = 4 / 2

    a, b = grid(3, 16, g=g), grid(8, 3, g=g)
    peft_like = {"layer.lora_A.weight": a.float(), "layer.lora_B.weight": b.float()}
    d_peft = b @ a

    strengths = (0.5, -0.75, 0.25, 1.125)
    report = shuttle.merge_lora(model, list(zip((kohya, loha, lokr, peft_like), strengths,
                                                strict=True)))

    ref_w = w0 + sum(m * d for m, d in zip(strengths, (d_kohya, d_loha, d_lokr, d_peft),
                                           strict=True))
    ref_b = b0 + strengths[0] * diff_b
    assert set(report.applied) == {"layer.weight", "layer.bias"}
    assert_bits_equal(model.layer.weight, ref_w.to(dtype))
    assert_bits_equal(model.layer.bias, ref_b.to(dtype))
    if dtype != torch.float32:
        assert rounding_matters(ref_w, dtype)


@pytest.mark.parametrize("prefix", ["base_model.model.", "transformer."], ids=["peft", "diffusers"])
def test_lora_bias_beside_a_dora_magnitude_takes_the_low_rank_scale(prefix, tmp_path):
    """A PEFT DoRA file with ``lora_B.bias`` (``lora_bias=True``): the bias update is scaled
    like the factors, ``strength * lora_alpha / r``, not left at 1 by the DoRA wrapper."""
    g = torch.Generator().manual_seed(6)
    model = Holder(nn.Linear(16, 8))
    set_weights(model, g)
    w0, b0 = model.layer.weight.detach().double(), model.layer.bias.detach().double()
    a, b, bias = grid(2, 16, g=g), grid(8, 2, g=g), grid(8, g=g)
    m = 1 + grid(8, g=g, k=8, denom=16)  # magnitudes in [0.5, 1.5]
    save_file({f"{prefix}layer.lora_A.weight": a.float(), f"{prefix}layer.lora_B.weight": b.float(),
               f"{prefix}layer.lora_B.bias": bias.float(),
               f"{prefix}layer.lora_magnitude_vector": m.float()},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 6, "use_dora": True, "lora_bias": True}))
    strength, scale = 0.5, 6 / 2

    report = shuttle.merge_lora(model, [(shuttle.load_lora(tmp_path), strength)])

    assert set(report.applied) == {"layer.weight", "layer.bias"} and not report.unmatched
    # bias: b + k * s * lora_B.bias, exact on the grid
    assert_bits_equal(model.layer.bias, (b0 + strength * scale * bias).float())
    # weight (PEFT's DoRA): V = W + k * s * B @ A, W' = m * V / ||V|| per output row
    v = w0 + strength * scale * (b @ a)
    ref_w = m[:, None] * v / v.norm(dim=1, keepdim=True)
    torch.testing.assert_close(model.layer.weight.double(), ref_w, rtol=1e-6, atol=1e-6)


# -- split q/k/v onto a fused qkv -----------------------------------------------------------------

class Attn(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=dtype)
        self.proj = nn.Linear(dim, dim, bias=False, dtype=dtype)


class Block(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.attn = Attn(dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("parts", [("to_q", "to_k", "to_v"), ("to_q", "to_v"), ("to_k",)],
                         ids=["qkv", "q_v", "k"])
def test_split_qkv_onto_fused_rows(dtype, parts):
    dim = 8
    g = torch.Generator().manual_seed(5)
    model = Block(dim, dtype)
    set_weights(model, g)
    w0 = model.attn.qkv.weight.detach().double()
    sd, ref = {}, w0.clone()
    for i, leaf in enumerate(("to_q", "to_k", "to_v")):
        if leaf not in parts:
            continue
        rank = i + 1  # a different rank per split
        a, b = grid(rank, dim, g=g), grid(dim, rank, g=g)
        sd[f"attn.{leaf}.lora_A.weight"] = a.float()
        sd[f"attn.{leaf}.lora_B.weight"] = b.float()
        ref[i * dim:(i + 1) * dim] += 0.5 * (b @ a)
    proj_before = model.attn.proj.weight.detach().clone()

    report = shuttle.merge_lora(model, [(sd, 0.5)])

    assert report.applied == ["attn.qkv.weight"]
    assert report.unmatched == {}
    assert_bits_equal(model.attn.qkv.weight, ref.to(dtype))
    assert_bits_equal(model.attn.proj.weight, proj_before)


# -- the report -----------------------------------------------------------------------------------

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 4)
        self.second = nn.Linear(4, 4)


def _pair(prefix: str, out: int, inp: int, g) -> dict[str, torch.Tensor]:
    return {f"{prefix}.lora_A.weight": grid(2, inp, g=g).float(),
            f"{prefix}.lora_B.weight": grid(out, 2, g=g).float()}


def test_report_applied_and_unmatched():
    g = torch.Generator().manual_seed(6)
    model = Two()
    sd = {**_pair("second", 4, 4, g), **_pair("first", 4, 8, g), **_pair("nowhere", 4, 4, g)}
    before = snapshot(model)
    report = shuttle.merge_lora(model, [(sd, 1.0)])
    assert report.applied == ["second.weight", "first.weight"]  # file order
    assert list(report.unmatched) == ["nowhere"]
    assert "no module" in report.unmatched["nowhere"]
    assert report.skipped == {}
    for n in ("first.bias", "second.bias"):
        assert_bits_equal(dict(model.named_parameters())[n], before[n])


def test_report_unmatched_names_the_source_when_several(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    path = tmp_path / "extra.safetensors"
    save_file({**_pair("first", 4, 8, g), **_pair("ghost", 4, 4, g)}, str(path))
    model = Two()
    report = shuttle.merge_lora(model, [(str(path), 1.0), (_pair("second", 4, 4, g), 1.0)])
    assert report.applied == ["first.weight", "second.weight"]
    assert list(report.unmatched) == [f"{path}::ghost"]


def test_report_lists_a_bias_update_and_its_weight():
    g = torch.Generator().manual_seed(8)
    model = Two()
    sd = {**_pair("first", 4, 8, g), "first.lora_B.bias": grid(4, g=g).float()}
    report = shuttle.merge_lora(model, [(sd, 1.0)])
    assert report.applied == ["first.weight", "first.bias"]


# -- exact-zero strength --------------------------------------------------------------------------

def test_zero_strength_skips_without_reading(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(9)
    path = tmp_path / "a.safetensors"
    save_file(_pair("first", 4, 8, g), str(path))
    lora = shuttle.load_lora(path)
    reads: list[str] = []
    real_read = SafetensorsFile.read

    def counting_read(self, key):
        reads.append(key)
        return real_read(self, key)

    monkeypatch.setattr(SafetensorsFile, "read", counting_read)
    model = Two()
    before = snapshot(model)

    for zero in (0.0, -0.0, 0, torch.tensor(0.0)):
        report = shuttle.merge_lora(model, [(lora, zero)])
        assert report.applied == [] and report.unmatched == {}
    assert reads == []
    assert_unchanged(model, before)

    # A zero-strength source is not even opened.
    shuttle.merge_lora(model, [(tmp_path / "missing.safetensors", 0.0)])
    assert_unchanged(model, before)

    # Next to a non-zero adapter only that one is read and applied.
    report = shuttle.merge_lora(model, [(lora, 0.0), (_pair("second", 4, 4, g), 1.0)])
    assert report.applied == ["second.weight"]
    assert reads == []
    assert_bits_equal(model.first.weight, before["first.weight"])
    assert not torch.equal(model.second.weight, before["second.weight"])


# -- stochastic rounding --------------------------------------------------------------------------

def _stochastic_model_and_adapter():
    g = torch.Generator().manual_seed(10)
    model = Holder(nn.Linear(8, 8, bias=False).to(torch.bfloat16))  # 64 elements
    with torch.no_grad():
        model.layer.weight.copy_(torch.randn(8, 8, generator=g) + 3.0)
    sd = {"layer.lora_A.weight": torch.randn(2, 8, generator=g) * 0.1,
          "layer.lora_B.weight": torch.randn(8, 2, generator=g) * 0.1}
    return model, shuttle.load_lora(sd), sd


def _merge_stochastic(model, lora, w_orig, seed):
    with torch.no_grad():
        model.layer.weight.copy_(w_orig)
    shuttle.merge_lora(model, [(lora, 1.0)], rounding="stochastic", seed=seed)
    return model.layer.weight.detach().clone()


def test_stochastic_rounding_repeatable_per_seed_and_name():
    model, lora, _ = _stochastic_model_and_adapter()
    w = model.layer.weight.detach().clone()
    a = _merge_stochastic(model, lora, w, seed=1)
    b = _merge_stochastic(model, lora, w, seed=1)
    c = _merge_stochastic(model, lora, w, seed=2)
    assert_bits_equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_rounding_seeded_by_parameter_name():
    """Two parameters with equal values and equal updates round differently."""
    g = torch.Generator().manual_seed(11)
    model = nn.Module()
    model.first = nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
    model.second = nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
    w = torch.randn(4, 4, generator=g) + 3.0
    with torch.no_grad():
        model.first.weight.copy_(w)
        model.second.weight.copy_(w)
    a, b = torch.randn(2, 4, generator=g) * 0.1, torch.randn(4, 2, generator=g) * 0.1
    sd = {f"{m}.{k}": v for m in ("first", "second")
          for k, v in (("lora_A.weight", a), ("lora_B.weight", b))}
    shuttle.merge_lora(model, [(sd, 1.0)], rounding="stochastic", seed=3)
    x = w.to(torch.bfloat16).double() + b.double() @ a.double()
    assert not torch.equal(model.first.weight, model.second.weight)
    for p in (model.first.weight, model.second.weight):
        assert ((p.double() - x).abs() < 2**-5).all()  # within one step for |x| < 8


def test_stochastic_rounding_is_unbiased():
    """Mean over 400 seeds of the merged bfloat16 weight converges to the float32 result.

    Each sample is one of the two bfloat16 neighbours of x, so its error has variance at most
    step**2 / 4; the mean of 400 has standard deviation at most step / 40. The bound is
    5 standard deviations: step / 8. Nearest rounding, by contrast, is off by up to step / 2.
    """
    model, lora, sd = _stochastic_model_and_adapter()
    w = model.layer.weight.detach().clone()
    x = w.double() + sd["layer.lora_B.weight"].double() @ sd["layer.lora_A.weight"].double()
    n = x.to(torch.bfloat16)
    above = n.double() > x
    lower = torch.where(above, torch.nextafter(n, n.new_tensor(-math.inf)), n)
    upper = torch.where(above, n, torch.nextafter(n, n.new_tensor(math.inf)))
    step = (upper.double() - lower.double())
    assert (step > 0).all()

    n_seeds = 400
    total = torch.zeros_like(x)
    for seed in range(n_seeds):
        r = _merge_stochastic(model, lora, w, seed=seed)
        assert ((r == lower) | (r == upper)).all(), "a stochastic result must be a neighbour"
        total += r.double()
    mean = total / n_seeds

    err = (mean - x).abs()
    assert (err <= step / 8).all(), f"max error {float((err / step).max()):.3f} steps"
    nearest_err = (n.double() - x).abs()
    assert err.mean() < nearest_err.mean() / 4


def test_stochastic_rounding_leaves_float32_at_nearest():
    g = torch.Generator().manual_seed(12)
    layer, sd, _, delta = _linear_case(torch.float32, g)
    model = Holder(layer)
    set_weights(model, g)
    w0 = layer.weight.detach().double()
    shuttle.merge_lora(model, [(sd, 1.0)], rounding="stochastic", seed=5)
    assert_bits_equal(layer.weight, (w0 + delta).float())


def test_unknown_rounding_is_rejected_before_any_change():
    g = torch.Generator().manual_seed(13)
    model = Two()
    before = snapshot(model)
    with pytest.raises(shuttle.errors.InvalidOptionError, match="rounding='down'"):
        shuttle.merge_lora(model, [(_pair("first", 4, 8, g), 1.0)], rounding="down")
    assert_unchanged(model, before)


# -- the fused kernel's path (CPU: the Triton interpreter) ------------------------------------

def _stack(n: int, dtype: torch.dtype) -> nn.Module:
    g = torch.Generator().manual_seed(21)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(12 + 4 * (i % 3), 20, bias=False) for i in range(n))
    model.to(dtype)
    set_weights(model, g)
    return model


@pytest.fixture
def kernel_merges(monkeypatch):
    """Route CPU merges of plain weights through the fused kernel (interpreted), as on CUDA;
    yields the weights' row counts as the kernel merged them."""
    from shuttle.apply import fused_jobs, merge
    from shuttle.kernels import interpreting, triton_available

    if not (triton_available() and interpreting()):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set on CPU)")
    monkeypatch.setattr(fused_jobs, "on_kernel_device", lambda p: True)
    calls = []
    real = merge.LowRankMerges.add
    monkeypatch.setattr(merge.LowRankMerges, "add",
                        lambda self, job: calls.append(job.w.shape[0]) or real(self, job))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_kernel_merge_equals_float64_reference(dtype, kernel_merges):
    """Two adapters on three weights: one kernel job per weight, both adapters joined along
    the rank; on dyadic inputs every float32 sum is exact, so each weight equals float64
    rounded once. float64 weights keep the float64 path (the kernel sums in float32)."""
    model = _stack(3, dtype)
    g = torch.Generator().manual_seed(22)
    sds = [{k: v for i, layer in enumerate(model.layers)
            for k, v in _pair(f"layers.{i}", layer.out_features, layer.in_features, g).items()}
           for _ in range(2)]
    before = snapshot(model)

    shuttle.merge_lora(model, [(sds[0], 0.75), (sds[1], -1.5)])

    assert kernel_merges == ([] if dtype == torch.float64 else [20, 20, 20])
    for i, layer in enumerate(model.layers):
        ref = before[f"layers.{i}.weight"].double()
        for sd, strength in ((sds[0], 0.75), (sds[1], -1.5)):
            ref += strength * (sd[f"layers.{i}.lora_B.weight"].double()
                               @ sd[f"layers.{i}.lora_A.weight"].double())
        assert_bits_equal(layer.weight, ref.to(dtype))


def test_kernel_merge_overflow_raises_after_the_merge(kernel_merges):
    """float16 overflow on the kernel path: the weight that could overflow is merged first
    (copied before), the kernel flags it, merge_lora reads the flag before merging the others
    and raises naming the weight, with every weight restored; apply_lora restores too."""
    model = _stack(3, torch.float16)
    before = snapshot(model)
    g = torch.Generator().manual_seed(24)
    sd = {k: v for i, layer in enumerate(model.layers)
          for k, v in _pair(f"layers.{i}", layer.out_features, layer.in_features, g).items()}
    sd["layers.1.lora_B.weight"] = torch.full((20, 2), 300.0)
    sd["layers.1.lora_A.weight"] = torch.full((2, 16), 300.0)
    with pytest.raises(shuttle.errors.NonFiniteAdapterError,
                       match=r"'layers\.1\.weight'.*Nothing was changed"):
        shuttle.merge_lora(model, [(sd, 1.0)])
    assert kernel_merges == [20]  # only the risky weight was merged before the check
    assert_unchanged(model, before)

    model = _stack(3, torch.float16)
    with pytest.raises(shuttle.errors.NonFiniteAdapterError), \
            shuttle.apply_lora(model, [(sd, 1.0)]):
        pytest.fail("the body must not run")
    assert_unchanged(model, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernel_checks_overflow_only_where_the_update_could_reach_it(dtype, kernel_merges,
                                                                      monkeypatch):
    """The kernel's overflow check is skipped where the adapter's measured magnitudes bound
    the update below the dtype's margin (float16: 16, bfloat16: 2**119): here every layer but
    float16's layer 1, whose factors of 300 could carry a weight past 65520."""
    from shuttle.apply import merge

    flagged = []
    inner = merge.LowRankMerges.add
    monkeypatch.setattr(merge.LowRankMerges, "add", lambda self, job: flagged.append(
        job.overflow is not None) or inner(self, job))
    model = _stack(3, dtype)
    g = torch.Generator().manual_seed(25)
    sd = {k: v for i, layer in enumerate(model.layers)
          for k, v in _pair(f"layers.{i}", layer.out_features, layer.in_features, g).items()}
    sd["layers.1.lora_B.weight"] = torch.full((20, 2), 300.0)
    sd["layers.1.lora_A.weight"] = torch.full((2, 16), 300.0)
    with contextlib.suppress(shuttle.errors.NonFiniteAdapterError):
        shuttle.merge_lora(model, [(sd, 1.0)])
    # float16: layer 1 is merged first (it may overflow) and does: the others never are
    assert flagged == ([True] if dtype == torch.float16 else [False, False, False])


def test_overflow_flag_made_only_for_updates_that_could_overflow(kernel_merges):
    """One flag per device, made at its first use: none at all (so merge_lora reads nothing
    back) when every update is bounded below its weight's margin."""
    from shuttle.apply import fused_jobs, plan

    model = _stack(3, torch.float16)
    g = torch.Generator().manual_seed(26)
    sd = {k: v for i, layer in enumerate(model.layers)
          for k, v in _pair(f"layers.{i}", layer.out_features, layer.in_features, g).items()}
    small = plan.plan_merge(model, [(sd, 1.0)])
    params = dict(model.named_parameters())
    flags: dict = {}
    assert all(fused_jobs.overflow_flag(params[n], cs, flags, small.memo) is None
               for n, cs in small.params.items())
    assert flags == {}
    sd["layers.1.lora_B.weight"] = torch.full((20, 2), 300.0)
    sd["layers.2.lora_B.weight"] = torch.full((20, 2), 300.0)
    large = plan.plan_merge(model, [(sd, 1.0)])
    got = [fused_jobs.overflow_flag(params[n], cs, flags, large.memo)
           for n, cs in large.params.items()]
    assert got[0] is None and got[1] is got[2] is flags[params["layers.1.weight"].device]


# -- apply_lora -----------------------------------------------------------------------------------

def _mixed_model() -> nn.Module:
    g = torch.Generator().manual_seed(14)
    model = nn.Module()
    model.first = nn.Linear(8, 4).to(torch.bfloat16)
    model.second = nn.Linear(4, 4).to(torch.float16)
    model.third = nn.Conv2d(2, 3, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        model.first.weight[0, :3] = torch.tensor([-0.0, 0.0, -0.0])  # signs of zero must return
    return model


def _mixed_adapter():
    g = torch.Generator().manual_seed(15)
    return {
        **{k: v.float() for k, v in _pair("first", 4, 8, g).items()},
        **{k: v.float() for k, v in _pair("second", 4, 4, g).items()},
        "lora_unet_third.lora_down.weight": torch.randn(2, 2, 3, 3, generator=g),
        "lora_unet_third.lora_up.weight": torch.randn(3, 2, 1, 1, generator=g),
        "lora_unet_third.diff_b": torch.randn(3, generator=g),
    }


@pytest.mark.parametrize("backup_device", [None, "cpu", torch.device("cpu")])
def test_apply_lora_restores_bit_for_bit(backup_device):
    model = _mixed_model()
    before = snapshot(model)
    merged = _mixed_model()
    expected_report = shuttle.merge_lora(merged, [(_mixed_adapter(), 0.7)])

    with shuttle.apply_lora(model, [(_mixed_adapter(), 0.7)],
                            backup_device=backup_device) as report:
        assert report.applied == expected_report.applied
        assert set(report.applied) == {"first.weight", "second.weight", "third.weight",
                                       "third.bias"}
        assert report.unmatched == {}
        for n, p in merged.named_parameters():
            assert_bits_equal(dict(model.named_parameters())[n], p)
        assert not torch.equal(model.first.weight, before["first.weight"])
    assert_unchanged(model, before)


def test_apply_lora_restores_when_the_body_raises():
    model = _mixed_model()
    before = snapshot(model)
    with pytest.raises(KeyError, match="boom"), \
            shuttle.apply_lora(model, [(_mixed_adapter(), 1.5)], backup_device="cpu"):
        assert not torch.equal(model.second.weight, before["second.weight"])
        raise KeyError("boom")
    assert_unchanged(model, before)


def test_apply_lora_restores_when_the_merge_overflows():
    """second.weight is float16: a huge strength overflows it after first.weight merged."""
    model = _mixed_model()
    before = snapshot(model)
    g = torch.Generator().manual_seed(16)
    sd = {**_pair("first", 4, 8, g), "second.lora_A.weight": torch.full((1, 4), 100.0),
          "second.lora_B.weight": torch.full((4, 1), 100.0)}
    with pytest.raises(shuttle.errors.NonFiniteAdapterError), \
            shuttle.apply_lora(model, [(sd, 1000.0)]):
        pytest.fail("the body must not run")
    assert_unchanged(model, before)


def test_apply_lora_nested_and_sequential():
    model = _mixed_model()
    before = snapshot(model)
    g = torch.Generator().manual_seed(17)
    other = _pair("first", 4, 8, g)
    with shuttle.apply_lora(model, [(_mixed_adapter(), 1.0)]):
        inner_before = snapshot(model)
        with shuttle.apply_lora(model, [(other, -2.0)], backup_device="cpu") as report:
            assert report.applied == ["first.weight"]
        assert_unchanged(model, inner_before)
    assert_unchanged(model, before)
    with shuttle.apply_lora(model, [(other, 0.0)]) as report:
        assert report.applied == []
    assert_unchanged(model, before)


def test_no_overflow_flag_where_the_kernel_does_not_run(kernel_merges):
    """A flag (and the sync that reads it) only for weights the fused kernel merges: none
    for a float64 weight or a patch other than a plain low-rank product, which take the
    float32/float64 path and raise on overflow themselves."""
    from shuttle.apply import fused_jobs, plan
    from shuttle.patches import Diff

    model = _stack(2, torch.float16)
    model.layers[1].double()
    g = torch.Generator().manual_seed(27)
    sd = {k: v for i, layer in enumerate(model.layers)
          for k, v in _pair(f"layers.{i}", layer.out_features, layer.in_features, g).items()}
    sd["layers.0.lora_B.weight"] = torch.full((20, 2), 300.0)
    sd["layers.1.lora_B.weight"] = torch.full((20, 2), 300.0)
    planned = plan.plan_merge(model, [(sd, 1.0)])
    params = dict(model.named_parameters())
    flags: dict = {}
    assert fused_jobs.overflow_flag(params["layers.1.weight"], planned.params["layers.1.weight"],
                               flags) is None  # float64: no kernel
    (c,) = planned.params["layers.0.weight"]
    assert fused_jobs.overflow_flag(params["layers.0.weight"], [c], flags) is not None
    dense = dataclasses.replace(c, patch=Diff("weight", torch.full((20, 12), 1e5)))
    assert fused_jobs.overflow_flag(params["layers.0.weight"], [dense], {}) is None
