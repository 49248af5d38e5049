"""Report notes: a kohya Flux split-qkv save is scaled per split, and every report says so.

The note's claim is checked against diffusers' own kohya Flux converter
(``_convert_kohya_flux_lora_to_diffusers``): on each split it gives 1/3 of shuttle's update on
``*_attn_qkv`` and 1/4 on ``linear1``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.apply import Note

DIM = 8
LINEAR1 = [3072, 3072, 3072, 12288]  # q, k, v, mlp rows of Flux's linear1 (the converter's)
KIND = "kohya-flux-split-qkv"
SPLIT = ["lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"]


class BflFlux(nn.Module):
    """BFL names; linear1 has Flux's 21504 rows over 4 inputs."""

    def __init__(self):
        super().__init__()
        double = nn.Module()
        for stream in ("img_attn", "txt_attn"):
            attn = nn.Module()
            attn.qkv = nn.Linear(DIM, 3 * DIM)
            attn.proj = nn.Linear(DIM, DIM)
            setattr(double, stream, attn)
        single = nn.Module()
        single.linear1 = nn.Linear(4, sum(LINEAR1))
        self.double_blocks = nn.ModuleList([double])
        self.single_blocks = nn.ModuleList([single])


def _block_diagonal(rows: list[int], rank: int, inp: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """kohya's split_qkv save: downs stacked to rank n*r, ups on the block diagonal."""
    ups = [torch.randn(r, rank, generator=g) for r in rows]
    return torch.block_diag(*ups), torch.randn(rank * len(rows), inp, generator=g)


def kohya_flux(split: bool = True) -> dict[str, torch.Tensor]:
    """img_attn_qkv and linear1 saved split (when ``split``), txt_attn_qkv and a proj dense."""
    g = torch.Generator().manual_seed(0)
    sd = {}
    if split:
        up, down = _block_diagonal([DIM] * 3, 2, DIM, g)
        sd |= {f"{SPLIT[0]}.lora_up.weight": up, f"{SPLIT[0]}.lora_down.weight": down,
               f"{SPLIT[0]}.alpha": torch.tensor(4.0)}
        up, down = _block_diagonal(LINEAR1, 2, 4, g)
        sd |= {f"{SPLIT[1]}.lora_up.weight": up, f"{SPLIT[1]}.lora_down.weight": down,
               f"{SPLIT[1]}.alpha": torch.tensor(3.0)}
    for name, rows in (("txt_attn_qkv", 3 * DIM), ("img_attn_proj", DIM)):
        key = f"lora_unet_double_blocks_0_{name}"
        sd |= {f"{key}.lora_up.weight": torch.randn(rows, 6, generator=g),
               f"{key}.lora_down.weight": torch.randn(6, DIM, generator=g),
               f"{key}.alpha": torch.tensor(2.0)}
    return sd


def assert_split_note(notes: list[Note], prefix: str = "") -> None:
    assert len(notes) == 1
    note = notes[0]
    assert note.kind == KIND and note.keys == tuple(prefix + k for k in SPLIT)
    assert "diffusers" in note.text and "1/3" in note.text and "1/4" in note.text


def test_merge_report_notes_split_qkv_modules():
    report = shuttle.merge_lora(BflFlux(), [(kohya_flux(), 0.5)])
    assert report.unmatched == {}
    assert_split_note(report.notes)


def test_split_over_diffusers_layers_is_one_key():
    """On diffusers' layout the split save lands on to_q, to_k, to_v: one adapter key."""
    model = nn.Module()
    model.transformer_blocks = nn.ModuleList([nn.Module()])
    model.transformer_blocks[0].attn = nn.Module()
    for leaf in ("to_q", "to_k", "to_v"):
        setattr(model.transformer_blocks[0].attn, leaf, nn.Linear(DIM, DIM))
    model.single_transformer_blocks = nn.ModuleList([nn.Module()])
    model.single_transformer_blocks[0].proj_mlp = nn.Linear(DIM, 4 * DIM)
    sd = {k: v for k, v in kohya_flux().items() if k.startswith(SPLIT[0])}
    report = shuttle.merge_lora(model, [(sd, 1.0)])
    assert len(report.applied) == 3 and report.unmatched == {}
    assert [(n.kind, n.keys) for n in report.notes] == [(KIND, (SPLIT[0],))]


def test_no_note_without_a_split_save():
    assert shuttle.merge_lora(BflFlux(), [(kohya_flux(split=False), 1.0)]).notes == []


def test_dynamic_and_scoped_reports_carry_it():
    model = BflFlux()
    handle = shuttle.attach_lora(model, [(kohya_flux(), 1.0)])
    try:
        assert_split_note(handle.report.notes)
    finally:
        handle.detach()
    with shuttle.apply_lora(model, [(kohya_flux(), 1.0)], mode="merge") as report:
        assert_split_note(report.notes)


def test_several_adapters_name_their_source(tmp_path):
    path = tmp_path / "split.safetensors"
    save_file(kohya_flux(), str(path))
    report = shuttle.merge_lora(BflFlux(), [(kohya_flux(split=False), 1.0), (path, 1.0)])
    assert_split_note(report.notes, prefix=f"{path}::")


def test_load_checkpoint_and_merge_files_reports_carry_it(tmp_path):
    model = BflFlux()
    ckpt = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(ckpt))
    assert_split_note(shuttle.load_checkpoint(BflFlux(), ckpt, loras=[(kohya_flux(), 1.0)]).notes)
    report = shuttle.merge_files(ckpt, [(kohya_flux(), 1.0)], tmp_path / "merged.safetensors")
    assert_split_note(report.notes)


def test_the_note_states_what_diffusers_does():
    """Per split, diffusers' converted factors give 1/3 (q, k, v) or 1/4 (linear1) of shuttle's
    update: it divides alpha by the stacked rank n*r where sd-scripts trained with alpha / r.
    """
    pytest.importorskip("diffusers")
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    kohya = kohya_flux()
    converted = _convert_kohya_flux_lora_to_diffusers({k: v.clone() for k, v in kohya.items()})
    model = BflFlux()
    for p in model.parameters():
        nn.init.zeros_(p)
    shuttle.merge_lora(model, [(kohya, 1.0)])
    cases = [(model.double_blocks[0].img_attn.qkv.weight, [DIM] * 3, "transformer_blocks.0.attn",
              ["to_q", "to_k", "to_v"]),
             (model.single_blocks[0].linear1.weight, LINEAR1, "single_transformer_blocks.0",
              ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"])]
    for weight, rows, block, leaves in cases:
        for ours, leaf in zip(weight.detach().double().split(rows), leaves, strict=True):
            a = converted[f"transformer.{block}.{leaf}.lora_A.weight"].double()
            b = converted[f"transformer.{block}.{leaf}.lora_B.weight"].double()
            torch.testing.assert_close(ours / len(rows), b @ a, rtol=1e-5, atol=1e-6)
