"""Real-size models of the families in ``shuttle.targets`` (on the ``meta`` device) and the key
layouts of LoRAs in their original names, written from them.

Each layout is what a trainer on the original code writes: a LoRA on every Linear and conv of the
layers it targets, named the original way. It is written forward from the diffusers model built
at real size: each diffusers layer's original name comes from the family's table
(``<family>_names.__wrapped__``, the table before lookup), its shapes from the layer. The tests
check each file against diffusers' own converters, which do not use that table.

Run ``.venv/bin/python -m tests.targets.family_layouts`` to write ``tests/data/family_keys/``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from shuttle.targets import ModelNames, Split

FAMILY_KEYS = Path(__file__).parents[1] / "data/family_keys"
RANK, CONV_RANK = 16, 8

# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(320, 640, 1280), transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816)
# stable-diffusion-v1-5, unet/config.json: diffusers' defaults with CLIP-L's 768 context
SD15_UNET = dict(sample_size=64, cross_attention_dim=768)
# Wan-AI/Wan2.1-I2V-14B-720P-Diffusers, transformer/config.json (T2V-14B: no image_dim and
# added_kv_proj_dim, which are diffusers' defaults)
WAN_I2V_14B = dict(image_dim=1280, added_kv_proj_dim=5120)
# hunyuanvideo-community/HunyuanVideo, transformer/config.json: diffusers' defaults


def build(kind: str) -> nn.Module:
    """The diffusers model ``kind`` at real size on the meta device."""
    import diffusers

    with torch.device("meta"):
        if kind == "sdxl":
            return diffusers.UNet2DConditionModel(**SDXL_UNET)
        if kind == "sd15":
            return diffusers.UNet2DConditionModel(**SD15_UNET)
        if kind == "wan_t2v":
            return diffusers.WanTransformer3DModel()
        if kind == "wan_i2v":
            return diffusers.WanTransformer3DModel(**WAN_I2V_14B)
        if kind == "hunyuan_video":
            return diffusers.HunyuanVideoTransformer3DModel()
    raise KeyError(kind)


def original_layers(model: nn.Module, table: Callable[[ModelNames], dict]
                    ) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Original module path -> (in, out, kernel) for every Linear/conv the table names, in the
    model's module order. A fused original layer is as tall as the rows its splits cover.
    """
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    found = []
    for original, place in table(ModelNames.of(model)).items():
        splits = [Split(place)] if isinstance(place, str) else place
        path = splits[0].path
        layer = model.get_submodule(path) if path in order else None
        if not isinstance(layer, nn.Linear | nn.Conv2d | nn.Conv3d):
            continue
        w = layer.weight
        out = w.shape[0] if splits[0].source_rows is None else max(
            s.source_rows[1] for s in splits)
        found.append((order[path], original, (w.shape[1], out, tuple(w.shape[2:]))))
    return {original: layer for _, original, layer in sorted(found)}


def lora_keys(layers: dict[str, tuple[int, int, tuple]], style: str,
              keep: Callable[[str], bool] = lambda path: True) -> dict[str, list[int]]:
    """Key -> shape of a LoRA on ``layers`` written in ``style``.

    ``kohya``: ``lora_unet_<path with _>.lora_down.weight`` / ``lora_up`` / ``alpha``;
    ``diffusion_model``: ``diffusion_model.<path>.lora_down.weight`` / ``lora_up`` / ``alpha``;
    ``peft:<prefix>``: ``<prefix><path>.lora_A.weight`` / ``lora_B`` (alpha in the config).
    Convs get the conv rank, a k x k down and a 1 x 1 up (LoCon).
    """
    out: dict[str, list[int]] = {}
    for path, (fan_in, fan_out, kernel) in layers.items():
        if not keep(path):
            continue
        r = CONV_RANK if kernel else RANK
        down, up = [r, fan_in, *kernel], [fan_out, r, *([1] * len(kernel))]
        if style == "kohya":
            name = "lora_unet_" + path.replace(".", "_")
            out |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                    f"{name}.alpha": []}
        elif style == "diffusion_model":
            name = "diffusion_model." + path
            out |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                    f"{name}.alpha": []}
        else:
            prefix = style.removeprefix("peft:")
            out |= {f"{prefix}{path}.lora_A.weight": down, f"{prefix}{path}.lora_B.weight": up}
    return out


def _in_blocks(path: str) -> bool:
    return path.startswith(("double_blocks.", "single_blocks.", "blocks."))


# file -> (model, spelling, which original layers)
FILES: dict[str, tuple[str, str, Callable[[str], bool] | None]] = {
    "sdxl-kohya-ldm.json": ("sdxl", "kohya", None),
    "sd15-comfy-ldm.json": ("sd15", "diffusion_model", None),
    "wan21-t2v-14b-musubi.json": ("wan_t2v", "kohya", _in_blocks),
    "wan21-i2v-14b-diffusion-model.json": ("wan_i2v", "peft:diffusion_model.", None),
    "hunyuan-video-diffusion-pipe.json": ("hunyuan_video", "peft:diffusion_model.", _in_blocks),
    "hunyuan-video-all-layers.json": ("hunyuan_video", "peft:transformer.", None),
}


def table_of(kind: str) -> Callable[[ModelNames], dict]:
    """The family's table builder (the family map before lookup) for model ``kind``."""
    from shuttle.targets.hunyuan_video import hunyuan_video_names
    from shuttle.targets.sd_unet import sd_unet_names
    from shuttle.targets.wan import wan_names

    family = {"sdxl": sd_unet_names, "sd15": sd_unet_names, "wan_t2v": wan_names,
              "wan_i2v": wan_names, "hunyuan_video": hunyuan_video_names}[kind]
    return family.__wrapped__


def layout(name: str, model: nn.Module | None = None) -> dict[str, list[int]]:
    """The layout of file ``name``, written from the model (built when not given)."""
    kind, style, keep = FILES[name]
    model = build(kind) if model is None else model
    keys = lora_keys(original_layers(model, table_of(kind)), style, keep or (lambda p: True))
    assert keys, f"{name}: the table placed no layer of the model"
    return keys


def load(name: str) -> dict[str, list[int]]:
    return json.loads((FAMILY_KEYS / name).read_text())


def write(names: Iterable[str], layout: Callable[[str], dict[str, list[int]]]) -> None:
    """Write each named layout file: one key per line, compact shapes."""
    for name in names:
        keys = layout(name)
        text = "{\n" + ",\n".join(f"{json.dumps(k)}:{json.dumps(s, separators=(',', ':'))}"
                                  for k, s in keys.items()) + "\n}\n"
        (FAMILY_KEYS / name).write_text(text)
        print(f"{name}: {len(keys)} keys")


def main() -> None:
    write(FILES, layout)


if __name__ == "__main__":
    main()
