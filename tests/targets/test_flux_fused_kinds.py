"""LoKr, LoHa and DoRA modules of BFL's fused Flux layers on diffusers' split layers.

Flux LyCORIS trainers write ``double_blocks_N_img_attn_qkv`` (rows q, k, v) and
``single_blocks_N_linear1`` (rows q, k, v, MLP input) as one LoKr or LoHa module. On diffusers'
``FluxTransformer2DModel`` each split layer gets its rows of the whole update. Oracles: the
whole update in float64 from the factors, split by rows and added to the split weights; a
BFL-layout twin (fused layers holding the same weights, the adapter placed whole) whose fused
layers must compute what the split ones compute; and merge for the dynamic and offloaded paths.
"""

from __future__ import annotations

import pytest
import torch

import shuttle
from shuttle.errors import UnsupportedLayerError
from shuttle.offload import ModelOffloader, StreamConfig
from shuttle.patches import LoKr
from shuttle.patches.select_rows import RowsOf, select_rows
from shuttle.targets import ModelNames

pytest.importorskip("diffusers")

H, M = 32, 128  # hidden and MLP width of the tiny model
STRENGTH = 0.7
EPS = torch.finfo(torch.float32).eps

# BFL module (dotted) -> the diffusers layers its rows go to, in row order
SPLITS = {
    "double_blocks.0.img_attn.qkv": [f"transformer_blocks.0.attn.{n}"
                                     for n in ("to_q", "to_k", "to_v")],
    "double_blocks.0.txt_attn.qkv": [f"transformer_blocks.0.attn.{n}"
                                     for n in ("add_q_proj", "add_k_proj", "add_v_proj")],
    "single_blocks.0.linear1": [f"single_transformer_blocks.0.{n}"
                                for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")],
}
ROWS = {"double_blocks.0.img_attn.qkv": 3 * H, "double_blocks.0.txt_attn.qkv": 3 * H,
        "single_blocks.0.linear1": 3 * H + M}


def _flux(fused: bool = False):
    """FLUX's transformer in miniature (hidden 32), as tests/integrations' tiny_flux."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8]).eval()
    if fused:
        m.fuse_qkv_projections()
    return m


def _run(m) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 4, generator=g),
              "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
              "pooled_projections": torch.randn(1, 32, generator=g),
              "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3),
              "txt_ids": torch.zeros(8, 3)}
    with torch.no_grad():
        return m(**inputs).sample


def _name(prefix: str, bfl: str) -> str:
    return prefix + bfl.replace(".", "_")


def _lokr(prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state dict, float64 whole update per BFL module). Factor rows do not follow the
    q/k/v boundaries: the qkv w2 has 24 rows, so rows 32 and 64 cut inside a w1 row block."""
    g = torch.Generator().manual_seed(2)
    sd, want = {}, {}
    for bfl, rows in ROWS.items():
        key = _name(prefix, bfl)
        w1 = torch.randn(4, 4, generator=g) * 0.3
        if bfl.startswith("single"):  # w2 decomposed: scale alpha / rank = 1 / 2
            a, b = torch.randn(rows // 4, 2, generator=g), torch.randn(2, H // 4, generator=g)
            sd |= {f"{key}.lokr_w1": w1, f"{key}.lokr_w2_a": a, f"{key}.lokr_w2_b": b,
                   f"{key}.alpha": torch.tensor(1.0)}
            want[bfl] = torch.kron(w1.double(), a.double() @ b.double()) * 0.5
        else:  # both factors whole: LyCORIS's scale is 1 whatever the alpha
            w2 = torch.randn(rows // 4, H // 4, generator=g) * 0.3
            sd |= {f"{key}.lokr_w1": w1, f"{key}.lokr_w2": w2, f"{key}.alpha": torch.tensor(4.0)}
            want[bfl] = torch.kron(w1.double(), w2.double())
    return sd, want


def _loha(prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    sd, want = {}, {}
    for bfl, rows in ROWS.items():
        key = _name(prefix, bfl)
        f = {n: torch.randn(*shape, generator=g) * 0.5 for n, shape in
             {"w1_a": (rows, 2), "w1_b": (2, H), "w2_a": (rows, 2), "w2_b": (2, H)}.items()}
        sd |= {f"{key}.hada_{n}": t for n, t in f.items()} | {f"{key}.alpha": torch.tensor(1.0)}
        d = {n: t.double() for n, t in f.items()}
        want[bfl] = (d["w1_a"] @ d["w1_b"]) * (d["w2_a"] @ d["w2_b"]) * 0.5
    return sd, want


KINDS = {"lokr": _lokr, "loha": _loha}
# kohya's sd-scripts names, and LyCORIS's own wrapper's
PREFIXES = ["lora_unet_", "lycoris_"]


def _weights(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _bfl_twin(model) -> torch.nn.Module:
    """The layers of ``model`` that BFL fuses, fused: q, k, v (and MLP input) stacked by rows."""
    twin = torch.nn.Module()
    params = dict(model.named_parameters())
    for bfl, layers in SPLITS.items():
        parent = twin
        *path, leaf = bfl.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.ModuleList([torch.nn.Module()])
                                  if part.endswith("blocks") else torch.nn.Module())
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        lin = torch.nn.Linear(H, ROWS[bfl])
        with torch.no_grad():
            lin.weight.copy_(torch.cat([params[f"{p}.weight"] for p in layers]))
            lin.bias.copy_(torch.cat([params[f"{p}.bias"] for p in layers]))
        parent.add_module(leaf, lin)
    return twin


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_merge_splits_the_whole_update_by_rows(kind, prefix):
    sd, want = KINDS[kind](prefix)
    model = _flux()
    before = _weights(model)
    report = shuttle.merge_lora(model, [(sd, STRENGTH)])
    assert report.unmatched == {}
    assert sorted(report.applied) == sorted(f"{p}.weight" for ps in SPLITS.values() for p in ps)
    after = dict(model.named_parameters())
    for bfl, layers in SPLITS.items():
        start = 0
        for path in layers:
            name = f"{path}.weight"
            rows = before[name].shape[0]
            expect = before[name].double() + STRENGTH * want[bfl][start:start + rows]
            torch.testing.assert_close(after[name].double(), expect, rtol=1e-6, atol=1e-6)
            start += rows
        assert start == ROWS[bfl]
    for name, w in before.items():  # biases and every other layer untouched
        if name not in report.applied:
            assert torch.equal(after[name], w), name


@pytest.mark.parametrize("kind", list(KINDS))
def test_split_layers_compute_what_the_fused_bfl_layers_compute(kind):
    """The same adapter merged into a BFL-layout twin (placed whole on its fused layers) gives
    the split layers' rows bit for bit, and the fused layers the split layers' outputs."""
    sd, _ = KINDS[kind]("lora_unet_")
    model = _flux()
    twin = _bfl_twin(model)
    shuttle.merge_lora(model, [(sd, STRENGTH)])
    report = shuttle.merge_lora(twin, [(sd, STRENGTH)])
    assert sorted(report.applied) == sorted(f"{b}.weight" for b in SPLITS)
    params, fused = dict(model.named_parameters()), dict(twin.named_parameters())
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(4))
    for bfl, layers in SPLITS.items():
        split = torch.cat([params[f"{p}.weight"] for p in layers])
        assert torch.equal(split, fused[f"{bfl}.weight"]), bfl
        with torch.no_grad():
            outs = torch.cat([model.get_submodule(p)(x) for p in layers], dim=-1)
            torch.testing.assert_close(outs, twin.get_submodule(bfl)(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", list(KINDS))
def test_dynamic_equals_merge(kind):
    sd, _ = KINDS[kind]("lycoris_")
    lora = shuttle.load_lora(sd)
    merged = _flux()
    shuttle.merge_lora(merged, [(lora, STRENGTH)])
    want = _run(merged)
    model = _flux()
    before, base = _weights(model), _run(model)
    assert not torch.allclose(want, base, atol=1e-3)
    with shuttle.apply_lora(model, [(lora, STRENGTH)], mode="dynamic"):
        torch.testing.assert_close(_run(model), want, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(_run(model), base)


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_offloaded_equals_merge(cpu_copy, mode):
    lora = shuttle.load_lora(_lokr("lora_unet_")[0])
    merged = _flux()
    shuttle.merge_lora(merged, [(lora, STRENGTH)])
    want = _run(merged)
    off = ModelOffloader.from_module(_flux(),
                                     blocks=["transformer_blocks", "single_transformer_blocks"])
    with off.use("cpu", StreamConfig(prefetch=1), loras=[(lora, STRENGTH)],
                 mode=mode) as m:
        got = _run(m)
    if mode == "merge":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_on_a_model_fused_in_place():
    """After diffusers' fuse_qkv_projections the rows also reach to_qkv / to_added_qkv."""
    sd, _ = _loha("lora_unet_")
    unfused = _flux()
    shuttle.merge_lora(unfused, [(sd, STRENGTH)])
    model = _flux(fused=True)
    report = shuttle.merge_lora(model, [(sd, STRENGTH)])
    assert "transformer_blocks.0.attn.to_qkv.weight" in report.applied
    assert "transformer_blocks.0.attn.to_added_qkv.weight" in report.applied
    torch.testing.assert_close(_run(model), _run(unfused), rtol=1e-5, atol=1e-5)


def _dora(magnitude_shape: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A LyCORIS LoKr DoRA on img_attn.qkv: (state dict, dora_scale)."""
    g = torch.Generator().manual_seed(5)
    key = "lycoris_double_blocks_0_img_attn_qkv"
    w1, w2 = torch.randn(4, 4, generator=g) * 0.3, torch.randn(24, 8, generator=g) * 0.3
    m = torch.rand(*magnitude_shape, generator=g) + 0.5
    return {f"{key}.lokr_w1": w1, f"{key}.lokr_w2": w2, f"{key}.dora_scale": m}, m


def test_dora_with_row_norms_splits_exactly():
    """A magnitude per output row normalizes each row by itself: split rows are exact. LyCORIS's
    rule (a ``lycoris_`` file): W' = V + k (m V / (||V|| + eps) - V), V = W + delta."""
    sd, m = _dora((3 * H, 1))
    layers = SPLITS["double_blocks.0.img_attn.qkv"]
    model = _flux()
    w = torch.cat([dict(model.named_parameters())[f"{p}.weight"] for p in layers]).double()
    shuttle.merge_lora(model, [(sd, STRENGTH)])
    key = "lycoris_double_blocks_0_img_attn_qkv"
    v = w + torch.kron(sd[f"{key}.lokr_w1"].double(), sd[f"{key}.lokr_w2"].double())
    d = m.double() * v / (torch.linalg.vector_norm(v, dim=1, keepdim=True) + EPS)
    want = v + STRENGTH * (d - v)
    got = torch.cat([dict(model.named_parameters())[f"{p}.weight"] for p in layers]).double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_dora_with_column_norms_is_refused_before_any_write():
    """A magnitude per input column normalizes over all 96 rows of the fused layer: no split
    layer can hold it. A typed error names the parameter; no weight changes."""
    sd, _ = _dora((1, H))
    # a module that would split fine is not merged either
    sd |= {k: v for k, v in _lokr("lycoris_")[0].items() if "txt_attn" in k}
    model = _flux()
    before = _weights(model)
    with pytest.raises(UnsupportedLayerError, match=r"to_q\.weight.*per input column"):
        shuttle.merge_lora(model, [(sd, STRENGTH)])
    with pytest.raises(UnsupportedLayerError, match="per input column"):
        shuttle.attach_lora(model, [(sd, STRENGTH)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # resolution itself places it (inspecting an adapter does not fail on it)
    res = shuttle.resolve(shuttle.load_lora(sd), model)
    assert res.unmatched == {}


def test_rows_of_a_lazy_lokr_read_nothing_until_loaded():
    class Ref:
        def __init__(self, t):
            self.t, self.reads = t, 0
            self.shape, self.dtype = t.shape, t.dtype

        def load(self):
            self.reads += 1
            return self.t

    g = torch.Generator().manual_seed(6)
    w1, w2 = Ref(torch.randn(4, 4, generator=g)), Ref(torch.randn(24, 8, generator=g))
    whole = LoKr("weight", w1=w1, w2=w2, scale=0.5)
    part = select_rows(whole, 32, 64)
    assert isinstance(part, RowsOf) and part.kind == "lokr" and part.out_rows == 32
    part.check((32, 32), "to_k.weight")
    assert (w1.reads, w2.reads) == (0, 0)
    loaded = part.load()
    assert loaded.load() is loaded  # real tensors: nothing to do next time
    want = torch.kron(w1.t.double(), w2.t.double())[32:64] * 0.5
    torch.testing.assert_close(loaded.delta((32, 32)).double(), want, rtol=1e-6, atol=1e-6)


def test_names_table_places_lycoris_wrapper_names():
    """LyCORIS's own ``lycoris_`` names of BFL modules go through the Flux table too."""
    sd, _ = _loha("lycoris_")
    res = shuttle.resolve(shuttle.load_lora(sd), ModelNames.of(_flux()))
    assert res.unmatched == {}
    assert {t.param for t in res.targets} == {f"{p}.weight" for ps in SPLITS.values()
                                              for p in ps}


def test_dynamic_over_a_quantized_split_layer_names_merge_mode():
    """A dense residual cannot ride a quantized layer's own forward: a typed error points to
    mode='merge' before anything is attached."""
    q = pytest.importorskip("torchao.quantization")
    model = _flux()
    q.quantize_(model, q.Int8WeightOnlyConfig(),
                filter_fn=lambda m, name: name == "transformer_blocks.0.attn.to_k")
    sd, _ = _lokr("lora_unet_")
    base = _run(model)
    with pytest.raises(UnsupportedLayerError, match=r"to_k\.weight: a lokr patch.*mode='merge'"):
        shuttle.attach_lora(model, [(sd, STRENGTH)])
    assert torch.equal(_run(model), base)
