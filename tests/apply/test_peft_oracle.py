"""Cross-checks of shuttle's merge against the peer libraries' own merges.

PEFT (float32 throughout, so the tolerances are a few float32 ulps):
    A small torch model (Linear layers, Conv2d layers, one with as many input as output channels,
    an Embedding) is wrapped by ``peft.get_peft_model`` with non-zero adapter weights
    (``init_lora_weights=False`` / ``init_weights=False``), saved with ``save_pretrained``, and
    merged by PEFT's ``merge_and_unload()``. shuttle loads the saved directory with
    ``shuttle.load_lora(dir)`` and merges it into a fresh copy of the base model. Every parameter
    of the two models is compared. Covered: LoRA with plain, rsLoRA and per-module
    ``rank_pattern``/``alpha_pattern`` scaling, DoRA, ``lora_bias``, embeddings,
    ``fan_in_fan_out`` (GPT-2 Conv1D), LoHa (plain, Tucker ``use_effective_conv2d``, patterns),
    LoKr (plain, ``decompose_both``, ``decompose_factor``, patterns); two adapters active at once
    against two shuttle adapters; and ``set_scale(adapter, k)`` against shuttle at strength k.

diffusers, Stable Diffusion kohya path (no downloads):
    A kohya ``lora_unet_*`` state dict for a tiny ``UNet2DConditionModel`` goes through
    ``StableDiffusionLoraLoaderMixin.lora_state_dict`` (kohya -> diffusers key conversion),
    ``load_lora_adapter`` and ``fuse_lora(lora_scale=k)``; shuttle merges the kohya dict itself at
    strength k into a copy of the same UNet. All parameters are compared.
    Not cross-checked: per-module alphas on attention projections. diffusers 0.42 keys their
    alphas as ``...processor.to_q_lora.down.weight.alpha``, which its PEFT config never matches,
    so those layers silently take the most common alpha. The test gives every attention
    projection one alpha (which becomes that default) and varies alpha and rank elsewhere.

diffusers, Flux kohya converter:
    ``_convert_kohya_flux_lora_to_diffusers`` turns a synthetic kohya Flux dict (BFL module
    names) into per-projection diffusers factors with alpha folded in; for each of q, k, v (and
    the single blocks' MLP) the delta ``B @ A`` it implies is compared with the rows shuttle
    merges into the fused BFL weight. For ordinary (dense) qkv LoRAs they agree. For kohya's
    ``split_qkv`` save (downs concatenated to rank n*r, block-diagonal up, alpha left as one
    split's) diffusers scales by alpha/(n*r) while kohya trained with alpha/r per split; shuttle
    follows the training-time scale, so there it equals n times diffusers' delta and equals the
    float64 per-split reference.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import shuttle

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = {"rtol": 1e-5, "atol": 1e-6}


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 12)
        self.b = nn.Linear(12, 8)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.sq = nn.Conv2d(4, 4, 3)  # in == out channels: axes of a conv DoRA magnitude
        self.emb = nn.Embedding(10, 6)


def make_base(seed: int = 0) -> Base:
    torch.manual_seed(seed)
    return Base()


def assert_models_close(actual: nn.Module, expected: nn.Module) -> None:
    exp = dict(expected.named_parameters())
    got = dict(actual.named_parameters())
    assert got.keys() == exp.keys()
    for n, p in got.items():
        torch.testing.assert_close(p, exp[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def peft_merged(base: nn.Module, config, save_dir, *, scale: float | None = None) -> nn.Module:
    """PEFT's own merge of ``config`` (with non-zero init) on a copy of ``base``; saves first."""
    pm = peft.get_peft_model(copy.deepcopy(base), config)
    pm.save_pretrained(str(save_dir))
    if scale is not None:
        layers = [m for m in pm.modules() if hasattr(m, "set_scale") and hasattr(m, "scaling")]
        assert layers
        for m in layers:
            m.set_scale("default", scale)
    return pm.merge_and_unload()


ALL = ["a", "b", "conv", "sq", "emb"]
CONFIGS = {
    "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL,
                                    init_lora_weights=False),
    "lora-rslora": lambda: peft.LoraConfig(r=4, lora_alpha=6, use_rslora=True,
                                           target_modules=ALL, init_lora_weights=False),
    "lora-patterns": lambda: peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False,
        rank_pattern={"b": 2, "conv": 3}, alpha_pattern={"conv": 3, "^a": 5, "emb": 1.5}),
    "lora-rslora-patterns": lambda: peft.LoraConfig(
        r=4, lora_alpha=8, use_rslora=True, target_modules=ALL, init_lora_weights=False,
        rank_pattern={"sq": 1}, alpha_pattern={"b": 2}),
    "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ALL,
                                    init_lora_weights=False),
    "dora-rslora": lambda: peft.LoraConfig(r=2, lora_alpha=3, use_dora=True, use_rslora=True,
                                           target_modules=["a", "b", "conv", "sq"],
                                           init_lora_weights=False),
    "lora-bias": lambda: peft.LoraConfig(r=2, lora_alpha=4, lora_bias=True,
                                         target_modules=["a", "b", "conv", "sq"],
                                         init_lora_weights=False),
    "loha": lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=["a", "b", "conv", "sq"],
                                    init_weights=False),
    "loha-effective-conv": lambda: peft.LoHaConfig(r=2, alpha=3, use_effective_conv2d=True,
                                                   target_modules=["a", "conv", "sq"],
                                                   init_weights=False),
    "loha-patterns": lambda: peft.LoHaConfig(r=2, alpha=8, rank_pattern={"a": 3},
                                             alpha_pattern={"conv": 5},
                                             target_modules=["a", "b", "conv"],
                                             init_weights=False),
    "lokr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=["a", "b", "conv", "sq"],
                                    init_weights=False),
    "lokr-decompose-both": lambda: peft.LoKrConfig(r=2, alpha=8, decompose_both=True,
                                                   use_effective_conv2d=True,
                                                   target_modules=["a", "b", "conv", "sq"],
                                                   init_weights=False),
    "lokr-factor": lambda: peft.LoKrConfig(r=2, alpha=3, decompose_factor=2,
                                           target_modules=["a", "b", "conv"],
                                           init_weights=False),
    "lokr-patterns": lambda: peft.LoKrConfig(r=2, alpha=8, rank_pattern={"b": 1},
                                             alpha_pattern={"^a": 2},
                                             target_modules=["a", "b", "conv"],
                                             init_weights=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_peft_merge_and_unload(name, tmp_path):
    base = make_base()
    config = CONFIGS[name]()
    expected = peft_merged(base, config, tmp_path)

    lora = shuttle.load_lora(tmp_path)
    assert lora.format == "peft"
    assert lora.config is not None and lora.config.peft_type == config.peft_type.value
    model = copy.deepcopy(base)
    report = shuttle.merge_lora(model, [(lora, 1.0)])

    targets = set(config.target_modules)
    assert {n.rsplit(".", 1)[0] for n in report.applied} == targets
    assert report.unmatched == {} and report.skipped == {}
    assert_models_close(model, expected)
    changed = {n for n, p in model.named_parameters()
               if not torch.equal(p, dict(base.named_parameters())[n])}
    assert {n.rsplit(".", 1)[0] for n in changed} == targets


@pytest.mark.parametrize("strength", [0.3, -1.5, 2.0])
@pytest.mark.parametrize("name", ["lora", "lora-rslora", "lora-patterns", "dora"])
def test_set_scale_equals_strength(name, strength, tmp_path):
    """PEFT's scaling times k (``set_scale``) is shuttle at strength k."""
    base = make_base(1)
    expected = peft_merged(base, CONFIGS[name](), tmp_path, scale=strength)
    model = copy.deepcopy(base)
    shuttle.merge_lora(model, [(tmp_path, strength)])
    assert_models_close(model, expected)


def test_two_active_adapters(tmp_path):
    """Two PEFT adapters active together merge as two shuttle adapters at strength 1."""
    base = make_base(2)
    pm = peft.get_peft_model(copy.deepcopy(base), CONFIGS["lora"]())
    pm.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=3, use_rslora=True,
                                             target_modules=["a", "conv"],
                                             init_lora_weights=False))
    pm.base_model.set_adapter(["default", "second"])
    pm.save_pretrained(str(tmp_path))
    expected = pm.merge_and_unload()

    model = copy.deepcopy(base)
    report = shuttle.merge_lora(model, [(tmp_path, 1.0), (tmp_path / "second", 1.0)])
    assert set(report.applied) == {f"{m}.weight" for m in ALL}
    assert_models_close(model, expected)


def test_fan_in_fan_out_conv1d(tmp_path):
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(3)
    base = nn.Module()
    base.c_attn = Conv1D(12, 8)  # weight (in, out): stored transposed
    base.c_proj = Conv1D(8, 12)
    config = peft.LoraConfig(r=2, lora_alpha=4, fan_in_fan_out=True,
                             target_modules=["c_attn", "c_proj"], init_lora_weights=False)
    expected = peft_merged(base, config, tmp_path)
    model = copy.deepcopy(base)
    assert shuttle.merge_lora(model, [(tmp_path, 1.0)]).applied == ["c_attn.weight",
                                                                    "c_proj.weight"]
    assert_models_close(model, expected)


# -- diffusers: kohya Stable Diffusion through lora_state_dict + load_lora_adapter + fuse_lora ----

def _tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(4)
    return UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
        norm_num_groups=2, attention_head_dim=2)


def _kohya_sd_dict(unet: nn.Module) -> dict[str, torch.Tensor]:
    """kohya SD1.x names: diffusers module paths with '.' -> '_' under ``lora_unet_``."""
    g = torch.Generator().manual_seed(5)
    sd = {}
    layers = [(n, m) for n, m in unet.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))
              and ("attentions" in n or "resnets.0.conv" in n or n == "conv_in")]
    for i, (name, m) in enumerate(layers):
        key = "lora_unet_" + name.replace(".", "_")
        attn = ".to_" in name
        rank = 2 if attn else 1 + i % 3
        w = m.weight
        if w.dim() == 4:  # LoCon: down carries the kernel, up is 1x1
            sd[f"{key}.lora_down.weight"] = torch.randn(rank, *w.shape[1:], generator=g)
            sd[f"{key}.lora_up.weight"] = torch.randn(w.shape[0], rank, 1, 1, generator=g)
        else:
            sd[f"{key}.lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g)
            sd[f"{key}.lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g)
        sd[f"{key}.alpha"] = torch.tensor(1.0 if attn else float(2 + i % 4))
    return sd


@pytest.mark.parametrize("strength", [1.0, 0.7])
def test_diffusers_kohya_sd_unet(strength):
    pytest.importorskip("diffusers")
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    unet = _tiny_unet()
    kohya = _kohya_sd_dict(unet)
    n_modules = sum(k.endswith(".lora_down.weight") for k in kohya)

    converted, alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(dict(kohya))[:2]
    expected = copy.deepcopy(unet)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected.load_lora_adapter(converted, prefix="unet", network_alphas=alphas,
                                   adapter_name="kohya")
        expected.fuse_lora(lora_scale=strength)
        expected.unload_lora()

    model = copy.deepcopy(unet)
    report = shuttle.merge_lora(model, [(kohya, strength)])
    assert len(report.applied) == n_modules and report.unmatched == {}
    assert_models_close(model, expected)


# -- diffusers: the Flux kohya converter, split q/k/v ------------------------------------------

FLUX_SPLITS = [3072, 3072, 3072, 12288]  # single blocks: q, k, v, mlp (fixed in the converter)


class FluxLike(nn.Module):
    """BFL module names; the single block's linear1 has Flux's 21504 rows but 4 inputs."""

    def __init__(self, dim: int = 8):
        super().__init__()
        double = nn.Module()
        double.img_attn = nn.Module()
        double.img_attn.qkv = nn.Linear(dim, 3 * dim)
        double.img_attn.proj = nn.Linear(dim, dim)
        double.txt_attn = nn.Module()
        double.txt_attn.qkv = nn.Linear(dim, 3 * dim)
        single = nn.Module()
        single.linear1 = nn.Linear(4, sum(FLUX_SPLITS))
        self.double_blocks = nn.ModuleList([double])
        self.single_blocks = nn.ModuleList([single])
        for p in self.parameters():
            nn.init.zeros_(p)


def _block_diagonal(rows: list[int], rank: int, inp: int, g):
    """kohya's split_qkv save: downs stacked to rank n*r, ups on the block diagonal."""
    downs = [torch.randn(rank, inp, generator=g) for _ in rows]
    ups = [torch.randn(r, rank, generator=g) for r in rows]
    up = torch.zeros(sum(rows), rank * len(rows))
    start = 0
    for j, u in enumerate(ups):
        up[start:start + u.shape[0], j * rank:(j + 1) * rank] = u
        start += u.shape[0]
    return up, torch.cat(downs), ups, downs


def test_diffusers_kohya_flux_converter_split_qkv():
    pytest.importorskip("diffusers")
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    dim, g = 8, torch.Generator().manual_seed(6)
    img_up, img_down, img_ups, img_downs = _block_diagonal([dim] * 3, 2, dim, g)
    one_up, one_down, one_ups, one_downs = _block_diagonal(FLUX_SPLITS, 2, 4, g)
    txt_up, txt_down = torch.randn(3 * dim, 6, generator=g), torch.randn(6, dim, generator=g)
    proj_up, proj_down = torch.randn(dim, 2, generator=g), torch.randn(2, dim, generator=g)
    alphas = {"img_attn_qkv": 4.0, "txt_attn_qkv": 3.0, "img_attn_proj": 1.0, "linear1": 3.0}
    kohya = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": img_up,
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": img_down,
        "lora_unet_double_blocks_0_txt_attn_qkv.lora_up.weight": txt_up,
        "lora_unet_double_blocks_0_txt_attn_qkv.lora_down.weight": txt_down,
        "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": proj_up,
        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": proj_down,
        "lora_unet_single_blocks_0_linear1.lora_up.weight": one_up,
        "lora_unet_single_blocks_0_linear1.lora_down.weight": one_down,
    }
    for name, alpha in alphas.items():
        block = "single_blocks_0" if name == "linear1" else "double_blocks_0"
        kohya[f"lora_unet_{block}_{name}.alpha"] = torch.tensor(alpha)

    converted = _convert_kohya_flux_lora_to_diffusers({k: v.clone() for k, v in kohya.items()})

    def implied(module: str) -> torch.Tensor:
        a = converted[f"transformer.{module}.lora_A.weight"].double()
        b = converted[f"transformer.{module}.lora_B.weight"].double()
        return b @ a

    model = FluxLike(dim)
    report = shuttle.merge_lora(model, [(kohya, 1.0)])
    assert report.unmatched == {}
    lora = shuttle.load_lora(kohya)
    assert lora.format == "kohya"

    def rows(weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(weight.detach().double().split(sizes))

    double = "transformer_blocks.0.attn"
    # Dense qkv (rank 6, not block diagonal): diffusers and shuttle agree.
    for got, leaf in zip(rows(model.double_blocks[0].txt_attn.qkv.weight, [dim] * 3),
                         ("add_q_proj", "add_k_proj", "add_v_proj"), strict=True):
        torch.testing.assert_close(got, implied(f"{double}.{leaf}"), **TOL)
    torch.testing.assert_close(model.double_blocks[0].img_attn.proj.weight.double(),
                               implied(f"{double}.to_out.0"), **TOL)

    # kohya split_qkv saves: shuttle applies alpha / r per split, diffusers alpha / (n * r).
    split_cases = [
        (model.double_blocks[0].img_attn.qkv.weight, [dim] * 3, img_ups, img_downs,
         [f"{double}.to_q", f"{double}.to_k", f"{double}.to_v"], alphas["img_attn_qkv"]),
        (model.single_blocks[0].linear1.weight, FLUX_SPLITS, one_ups, one_downs,
         [f"single_transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v",
                                                       "proj_mlp")], alphas["linear1"]),
    ]
    for weight, sizes, ups, downs, modules, alpha in split_cases:
        n = len(sizes)
        for got, up, down, module in zip(rows(weight, sizes), ups, downs, modules, strict=True):
            kohya_training = up.double() @ down.double() * (alpha / down.shape[0])
            torch.testing.assert_close(got, kohya_training, **TOL)
            torch.testing.assert_close(got, n * implied(module), **TOL)
