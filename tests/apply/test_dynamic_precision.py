"""Dynamic adapters whose factors have another dtype than their layer (fp16 files, as most
published ones are, on float32 and bf16 layers; a bf16 file on an fp16 layer): outputs finite at
inputs beyond fp16's range and as close to float64 as the merged model's, for every tier, the
Conv and Embedding kinds, LoHa/LoKr/DoRA and tensor-parallel layers; the exact tier's chain in
the promoted dtype, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shuttle

BIG = 3e5  # inputs beyond fp16's largest finite value (65504)
# error of a whole output against float64: float32 layers as close as the merged model's
# (about 1e-7); bf16 layers within bf16's rounding of the output
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _kohya(prefix, out_f, in_f, rank, g, dtype, scale=0.3):
    return {f"{prefix}.lora_down.weight": (torch.randn(rank, in_f, generator=g) * scale).to(dtype),
            f"{prefix}.lora_up.weight": (torch.randn(out_f, rank, generator=g) * scale).to(dtype),
            f"{prefix}.alpha": torch.tensor(float(rank) / 2)}


def _peft(prefix, out_f, in_f, rank, g, dtype, scale=0.3):
    return {f"{prefix}.lora_A.weight": (torch.randn(rank, in_f, generator=g) * scale).to(dtype),
            f"{prefix}.lora_B.weight": (torch.randn(out_f, rank, generator=g) * scale).to(dtype)}


def _error(got, ref64):
    assert torch.isfinite(got).all(), "non-finite outputs"
    return float((got.detach().double() - ref64).norm() / ref64.norm())


def _float64_output(model, sd, strength, call):
    """``call(model)`` on a float64 copy of ``model`` with ``sd`` merged (deltas are float32
    before the add: 1e-7 of the update off, far below every tolerance here)."""
    wide = copy.deepcopy(model).double()
    shuttle.merge_lora(wide, [(sd, strength)])
    with torch.no_grad():
        return call(wide).double()


def _linear(dtype):
    torch.manual_seed(0)
    m = nn.Module()
    m.lin = nn.Linear(32, 24).to(dtype)
    return m


@pytest.mark.parametrize("quality", ["exact", "lossless", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", [_kohya, _peft])
@pytest.mark.parametrize("magnitude", [1.0, BIG])
def test_fp16_factors_on_a_wider_linear_are_finite_and_as_close_as_merged(quality, dtype, style,
                                                                         magnitude):
    g = torch.Generator().manual_seed(1)
    m = _linear(dtype)
    sd = style("lin", 24, 32, 4, g, torch.float16)
    x = (torch.randn(6, 32, generator=g) * magnitude).to(dtype)
    ref = _float64_output(m, sd, 0.8, lambda w: w.lin(x.double()))
    merged = copy.deepcopy(m)
    shuttle.merge_lora(merged, [(sd, 0.8)])
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality=quality):
        err = _error(m.lin(x), ref)
        merged_err = _error(merged.lin(x), ref)
    assert err < TOL[dtype], (err, merged_err)
    if dtype == torch.float32:
        assert err < 3 * merged_err, (err, merged_err)  # comparable to the merged model


@pytest.mark.parametrize(("layer", "file", "chain"), [
    (torch.bfloat16, torch.float16, torch.float32),
    (torch.float32, torch.float16, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float16, torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
])
def test_exact_tier_runs_its_chain_in_the_promoted_dtype_bit_for_bit(layer, file, chain):
    g = torch.Generator().manual_seed(2)
    m = _linear(layer)
    sd = _peft("lin", 24, 32, 4, g, file)
    sd["lin.alpha"] = torch.tensor(2.0)
    x = torch.randn(2, 3, 32, generator=g).to(layer)
    with torch.no_grad():
        base = m.lin(x)
        a, b = sd["lin.lora_A.weight"].to(chain), sd["lin.lora_B.weight"].to(chain)
        want = base + ((x.to(chain) @ a.T @ b.T) * 0.5 * 0.7).to(layer)
        with shuttle.apply_lora(m, [(sd, 0.7)], mode="dynamic", quality="exact"):
            got = m.lin(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("quality", ["lossless", "fused"])
def test_bf16_factors_on_an_fp16_linear_keep_their_range(quality):
    """bf16 factors of 1e-6 are subnormal in fp16 (about 6% off there): they are kept in
    float32."""
    g = torch.Generator().manual_seed(3)
    m = _linear(torch.float16)
    sd = _peft("lin", 24, 32, 4, g, torch.bfloat16, scale=1e-6)
    sd["lin.alpha"] = torch.tensor(4e12)  # scale 1e12: an update as large as the output
    x = torch.randn(6, 32, generator=g).half()
    ref = _float64_output(m, sd, 1.0, lambda w: w.lin(x.double()))
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 1.0)], mode="dynamic", quality=quality):
        got = m.lin(x)
    with torch.no_grad():
        base = m.lin(x).double()
    assert float((ref - base).norm() / ref.norm()) > 0.3  # the update is a visible part
    assert _error(got, ref) < TOL[torch.float16]


def _conv_and_embedding(dtype):
    torch.manual_seed(0)
    m = nn.Module()
    m.conv = nn.Conv2d(3, 8, 3, padding=1).to(dtype)
    m.emb = nn.Embedding(20, 6).to(dtype)
    return m


def _conv_and_embedding_sd(g, dtype):
    return {"conv.lora_down.weight": (torch.randn(2, 3, 3, 3, generator=g) * 0.3).to(dtype),
            "conv.lora_up.weight": (torch.randn(8, 2, 1, 1, generator=g) * 0.3).to(dtype),
            "conv.alpha": torch.tensor(1.0),
            "base_model.model.emb.lora_embedding_A":
                (torch.randn(3, 20, generator=g) * 0.5).to(dtype),
            "base_model.model.emb.lora_embedding_B":
                (torch.randn(6, 3, generator=g) * 0.5).to(dtype)}


@pytest.mark.parametrize("quality", ["exact", "lossless"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1.0, BIG])
def test_fp16_factors_on_wider_conv_and_embedding_layers(quality, dtype, magnitude):
    """The Embedding kind's chain ran in the factors' fp16 (a float32 table 1e-4 off); the
    Conv kind cast its factors to the input's dtype (already finite at large inputs)."""
    g = torch.Generator().manual_seed(4)
    m = _conv_and_embedding(dtype)
    sd = _conv_and_embedding_sd(g, torch.float16)
    x = (torch.randn(2, 3, 5, 5, generator=g) * magnitude).to(dtype)
    ids = torch.tensor([[1, 4, 19], [0, 2, 2]])
    conv_ref = _float64_output(m, sd, 0.6, lambda w: w.conv(x.double()))
    emb_ref = _float64_output(m, sd, 0.6, lambda w: w.emb(ids))
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.6)], mode="dynamic", quality=quality):
        assert _error(m.conv(x), conv_ref) < TOL[dtype]
        assert _error(m.emb(ids), emb_ref) < TOL[dtype]


@pytest.mark.parametrize("file", [torch.float16, torch.float32])
def test_exact_tier_on_a_bf16_conv_and_embedding_runs_in_float32(file):
    """As on a Linear: fp16 or float32 factors on bf16 layers chain in float32, rounded once
    (their factors were rounded to bf16 before)."""
    g = torch.Generator().manual_seed(5)
    m = _conv_and_embedding(torch.bfloat16)
    sd = _conv_and_embedding_sd(g, file)
    x = torch.randn(2, 3, 5, 5, generator=g).bfloat16()
    ids = torch.tensor([[1, 4, 19], [0, 2, 2]])
    down = sd["conv.lora_down.weight"].float()
    up = sd["conv.lora_up.weight"].float()
    a = sd["base_model.model.emb.lora_embedding_A"].float()
    b = sd["base_model.model.emb.lora_embedding_B"].float()
    with torch.no_grad():
        conv_want = m.conv(x) + (F.conv2d(F.conv2d(x.float(), down, padding=1), up) * 0.5
                                 * 0.6).bfloat16()
        emb_want = m.emb(ids) + ((F.embedding(ids, a.T) @ b.T) * 0.6).bfloat16()
        with shuttle.apply_lora(m, [(sd, 0.6)], mode="dynamic", quality="exact"):
            assert torch.equal(m.conv(x), conv_want)
            assert torch.equal(m.emb(ids), emb_want)


def _lycoris_sd(g, dtype):
    """LoHa on ``a``, LoKr on ``b``, DoRA (kohya factors with a dora_scale) on ``c``."""
    def r(*shape, s=0.3):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return {"a.hada_w1_a": r(24, 2), "a.hada_w1_b": r(2, 32),
            "a.hada_w2_a": r(24, 2), "a.hada_w2_b": r(2, 32),
            "b.lokr_w1": r(4, 4), "b.lokr_w2": r(6, 8),
            "c.lora_down.weight": r(4, 32), "c.lora_up.weight": r(24, 4),
            "c.dora_scale": (torch.rand(24, 1, generator=g) + 0.5).to(dtype)}


@pytest.mark.parametrize("quality", ["exact", "lossless"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1.0, BIG])
def test_fp16_loha_lokr_and_dora_on_wider_layers(quality, dtype, magnitude):
    """These run as float32 weight residuals (W + R rounded once to the weight's dtype, then
    the layer's own forward): right before this change too, pinned here."""
    g = torch.Generator().manual_seed(6)
    torch.manual_seed(0)
    m = nn.Module()
    m.a, m.b, m.c = nn.Linear(32, 24), nn.Linear(32, 24), nn.Linear(32, 24)
    m.to(dtype)
    sd = _lycoris_sd(g, torch.float16)
    x = (torch.randn(6, 32, generator=g) * magnitude).to(dtype)
    refs = _float64_output(m, sd, 0.8, lambda w: torch.stack([w.a(x.double()), w.b(x.double()),
                                                               w.c(x.double())]))
    with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality=quality) as h, \
            torch.no_grad():
        assert len(h.applied) == 3
        for name, ref in zip("abc", refs, strict=True):
            assert _error(getattr(m, name)(x), ref) < TOL[dtype], name


def _tensor_parallel_output(dtype):
    """The model on a one-rank mesh (gloo, in this process): its weights DTensors, so the
    hooks take their tensor-parallel forward; the sharded math itself is tested on 2 and 4
    ranks in test_sharded.py."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 6)).to(dtype)
    g = torch.Generator().manual_seed(7)
    sd = _peft("0", 12, 8, 4, g, torch.float16) | _peft("1", 6, 12, 4, g, torch.float16)
    x = (torch.randn(5, 8, generator=g) * BIG).to(dtype)
    ref = _float64_output(model, sd, 0.7, lambda w: w(x.double()))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        with torch.no_grad(), shuttle.apply_lora(model, [(sd, 0.7)], mode="dynamic") as h:
            assert all(hook.sharded for hook in h.hooks.values())
            got = model(x)
            got = got.full_tensor() if hasattr(got, "full_tensor") else got.clone()
    finally:
        dist.destroy_process_group()
    return got, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp16_factors_on_tensor_parallel_layers_at_large_inputs(dtype):
    """The tensor-parallel forward computes in the promotion of x's dtype and the stored
    factors' (right before this change too: those were never narrower than x): pinned here."""
    pytest.importorskip("torch.distributed.tensor")
    got, ref = _tensor_parallel_output(dtype)
    assert _error(got, ref) < TOL[dtype]


@pytest.mark.parametrize(("scale", "bound"), [(0.3, 1.25), (0.1, 1.0)])
def test_lossless_on_fp16_factors_on_a_bf16_layer_stays_within_its_documented_bound(scale,
                                                                                   bound):
    """Its factors rounded to bf16 at attach: at most 1.25x the exact tier's (float32 chain)
    error against float64 where the update is as large as the base output, no more than it
    where the update is a few tenths of it (docs/dynamic.md)."""
    for seed in range(3):
        g = torch.Generator().manual_seed(10 + seed)
        m = _linear(torch.bfloat16)
        sds = [_kohya("lin", 24, 32, 8, g, torch.float16, scale),
               _peft("lin", 24, 32, 5, g, torch.float16, scale)]
        loras = [(sds[0], 0.8), (sds[1], -0.4)]
        x = torch.randn(40, 32, generator=g).bfloat16()
        ref = torch.nn.functional.linear(x.double(), m.lin.weight.double(), m.lin.bias.double())
        for sd, (k, s) in zip(sds, ((0.8, 0.5), (-0.4, 1.0)), strict=True):
            a, b = (sd[f"lin.lora_{n}.weight"] for n in (("down", "up") if "lin.alpha" in sd
                                                         else ("A", "B")))
            ref = ref + k * s * (x.double() @ a.double().T @ b.double().T)
        errs = {}
        for q in ("exact", "lossless"):
            with torch.no_grad(), shuttle.apply_lora(m, loras, mode="dynamic", quality=q):
                errs[q] = _error(m.lin(x), ref)
        assert errs["lossless"] <= bound * errs["exact"], (seed, errs)


@pytest.mark.gpu
@pytest.mark.parametrize("quality", ["exact", "lossless", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [6, 200], ids=["decode", "prefill"])
def test_gpu_fp16_factors_on_a_wider_linear_at_large_inputs(quality, dtype, tokens):
    """On CUDA every tier takes its GPU path: the decode kernels (lossless's one-launch update
    and fused's lora_decode_linear at 6 tokens), cuBLAS and the fused Triton kernels."""
    g = torch.Generator().manual_seed(8)
    m = _linear(dtype)
    sd = _kohya("lin", 24, 32, 4, g, torch.float16)
    x = (torch.randn(tokens, 32, generator=g) * BIG).to(dtype)
    ref = _float64_output(m, sd, 0.8, lambda w: w.lin(x.double()))
    m.cuda()
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality=quality):
        got = m.lin(x.cuda()).cpu()
    assert _error(got, ref) < TOL[dtype]
