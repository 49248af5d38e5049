"""A component's weights from an original single-file checkpoint: a tiny Flux transformer
written in Black Forest Labs' layout (fused qkv, fused single-block linear1, the final
modulation's halves swapped, RMSNorm ``scale``) and placed by shuttle's Flux table.

The BFL file is written here from the diffusers weights by its own rules (the layout as BFL's
code defines it), independently of the table that reads it back.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import CheckpointMismatchError, MissingParameterError, OffloadError
from shuttle.integrations import diffusers as shuttle_diffusers
from tests.integrations import fake_hub
from tests.integrations.models import run_flux, tiny_flux

pytest.importorskip("diffusers")

_TOP = {"img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
        "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
        "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
        "vector_in.out_layer": "time_text_embed.text_embedder.linear_2"}
_DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
           "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
           "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
           "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"}
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_DOUBLE_NORMS = {"img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
                 "txt_attn.norm.query_norm": "attn.norm_added_q",
                 "txt_attn.norm.key_norm": "attn.norm_added_k"}
_SINGLE = {"linear2": "proj_out", "modulation.lin": "norm.linear"}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}


def bfl_state_dict(sd: dict[str, torch.Tensor], n_double: int, n_single: int
                   ) -> dict[str, torch.Tensor]:
    """diffusers' FluxTransformer2DModel weights in BFL's layout; every tensor used once."""
    left = dict(sd)
    out = {}

    def take(dst: str, src: str, leaves=("weight", "bias")) -> None:
        for leaf in leaves:
            if f"{src}.{leaf}" in left:
                out[f"{dst}.{leaf}"] = left.pop(f"{src}.{leaf}")

    def fuse(dst: str, srcs: tuple[str, ...]) -> None:
        for leaf in ("weight", "bias"):
            out[f"{dst}.{leaf}"] = torch.cat([left.pop(f"{s}.{leaf}") for s in srcs])

    for bfl, dif in _TOP.items():
        take(bfl, dif)
    scale, shift = left.pop("norm_out.linear.weight").chunk(2)  # diffusers: (scale, shift)
    out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
    scale, shift = left.pop("norm_out.linear.bias").chunk(2)
    out["final_layer.adaLN_modulation.1.bias"] = torch.cat([shift, scale])
    for i in range(n_double):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for bfl, dif in _DOUBLE.items():
            take(f"{b}.{bfl}", f"{d}.{dif}")
        for bfl, difs in _DOUBLE_FUSED.items():
            fuse(f"{b}.{bfl}", tuple(f"{d}.{x}" for x in difs))
        for bfl, dif in _DOUBLE_NORMS.items():
            out[f"{b}.{bfl}.scale"] = left.pop(f"{d}.{dif}.weight")
    for i in range(n_single):
        d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for bfl, dif in _SINGLE.items():
            take(f"{b}.{bfl}", f"{d}.{dif}")
        fuse(f"{b}.linear1", tuple(f"{d}.{x}" for x in ("attn.to_q", "attn.to_k", "attn.to_v",
                                                         "proj_mlp")))
        for bfl, dif in _SINGLE_NORMS.items():
            out[f"{b}.{bfl}.scale"] = left.pop(f"{d}.{dif}.weight")
    assert not left, sorted(left)
    return out


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(pipeline folder, BFL weights of its transformer, the saved pipeline's latents)."""
    root = tmp_path_factory.mktemp("flux")
    pipe = tiny_flux()
    pipe.save_pretrained(root)
    bfl = bfl_state_dict(pipe.transformer.state_dict(), 2, 3)
    return root, bfl, run_flux(pipe)


def write(path, tensors):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_an_original_flux_file_gives_the_saved_pipeline(saved, tmp_path, prefix, monkeypatch):
    from shuttle.formats.safetensors_file import SafetensorsFile

    root, bfl, latents = saved
    file = write(tmp_path / "flux1-tiny.safetensors", {prefix + k: v for k, v in bfl.items()})
    reads = []
    original = SafetensorsFile._read_copy

    def recorded(self, begin, end, raw=None):
        if self.path == file:
            reads.append((begin, end))
        return original(self, begin, end, raw)

    monkeypatch.setattr(SafetensorsFile, "_read_copy", recorded)
    pipe, handle = shuttle_diffusers.from_pretrained(root, device="cpu",
                                                     weights={"transformer": file})
    assert torch.equal(run_flux(pipe), latents)
    # Each byte of the file's tensors read once (the fused ones as their parts), into place.
    spans = sorted(reads)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert sum(e - b for b, e in spans) == sum(t.nbytes for t in bfl.values())
    handle.remove()


def test_an_original_file_converts_to_torch_dtype_by_rows(saved, tmp_path):
    root, bfl, _ = saved
    file = write(tmp_path / "flux1-tiny.safetensors", bfl)
    ref, ref_handle = shuttle_diffusers.from_pretrained(root, device="cpu",
                                                        torch_dtype=torch.bfloat16)
    expected = run_flux(ref)
    ref_handle.remove()
    pipe, handle = shuttle_diffusers.from_pretrained(root, device="cpu", torch_dtype=torch.bfloat16,
                                                     weights={"transformer": file})
    assert pipe.transformer.dtype == torch.bfloat16
    assert torch.equal(run_flux(pipe), expected)
    handle.remove()


def test_an_original_file_that_does_not_fit_is_refused(saved, tmp_path):
    root, bfl, _ = saved
    short = dict(bfl)
    short["double_blocks.1.img_attn.qkv.weight"] = bfl["double_blocks.1.img_attn.qkv.weight"][:90]
    with pytest.raises(CheckpointMismatchError, match=r"double_blocks\.1\.img_attn\.qkv\.weight'"
                                                      r" \(90, 32\) is cut into rows"):
        shuttle_diffusers.from_pretrained(root, device="cpu", weights={
            "transformer": write(tmp_path / "short.safetensors", short)})
    missing = {k: v for k, v in bfl.items() if not k.startswith("single_blocks.2.linear2")}
    with pytest.raises(MissingParameterError,
                       match=r"single_transformer_blocks\.2\.proj_out\.weight"):
        shuttle_diffusers.from_pretrained(root, device="cpu", weights={
            "transformer": write(tmp_path / "missing.safetensors", missing)})
    with pytest.raises(OffloadError, match=r"weights= names \['unet'\]"):
        shuttle_diffusers.from_pretrained(root, device="cpu", weights={"unet": tmp_path})


def test_a_hub_pipeline_with_an_original_file_fetches_that_component_s_config_only(
        tmp_path, monkeypatch, saved):
    import shutil

    root, bfl, latents = saved
    repo = tmp_path / "repo"
    shutil.copytree(root, repo)
    fetched: set[str] = set()
    fake_hub(monkeypatch, repo, fetched)
    file = write(tmp_path / "flux1-tiny.safetensors", bfl)
    pipe, handle = shuttle_diffusers.from_pretrained("owner/repo", revision="v1", device="cpu",
                                                     weights={"transformer": file})
    assert "transformer/config.json" in fetched and "vae/config.json" in fetched
    assert "transformer/diffusion_pytorch_model.safetensors" not in fetched
    assert torch.equal(run_flux(pipe), latents)
    handle.remove()


def test_a_file_in_the_model_s_own_names_for_a_transformers_component(saved, tmp_path):
    from safetensors.torch import load_file

    root, _, latents = saved
    own = load_file(root / "text_encoder_2" / "model.safetensors")
    file = write(tmp_path / "t5.safetensors", own)
    pipe, handle = shuttle_diffusers.from_pretrained(root, device="cpu",
                                                     weights={"text_encoder_2": file})
    assert torch.equal(run_flux(pipe), latents)
    handle.remove()
    wrong = write(tmp_path / "wrong.safetensors", {"x.weight": torch.zeros(1), **own})
    with pytest.raises(CheckpointMismatchError, match=r"wrong\.safetensors.*'x\.weight'"):
        shuttle_diffusers.from_pretrained(root, device="cpu", weights={"text_encoder_2": wrong})


def test_an_original_float8_file_keeps_its_float8_weights(saved, tmp_path):
    root, bfl, _ = saved
    # as the fp8 releases of Flux hold it: the 2-D weights in float8_e4m3fn, the rest in bf16
    file = write(tmp_path / "flux1-tiny-fp8.safetensors",
                 {k: v.to(torch.float8_e4m3fn if v.dim() == 2 else torch.bfloat16)
                  for k, v in bfl.items()})
    outs = []
    for float8 in ("keep", "widen"):
        pipe, handle = shuttle_diffusers.from_pretrained(
            root, device="cpu", torch_dtype=torch.bfloat16, weights={"transformer": file},
            float8=float8)
        to_q = pipe.transformer.transformer_blocks[0].attn.to_q.weight  # rows of a fused qkv
        assert to_q.dtype == (torch.float8_e4m3fn if float8 == "keep" else torch.bfloat16)
        assert pipe.transformer.dtype == torch.bfloat16
        outs.append(run_flux(pipe))
        handle.remove()
    assert torch.equal(*outs)


@pytest.mark.parametrize("leaf", ["scale_weight", "weight_scale"])
def test_a_scaled_float8_file_is_refused_naming_the_releases_that_load(saved, tmp_path, leaf):
    root, bfl, _ = saved
    tensors = {k: v.to(torch.float8_e4m3fn if v.dim() == 2 else torch.bfloat16)
               for k, v in bfl.items()}
    # ComfyUI's fp8_scaled layout: a float32 scale beside each float8 weight
    tensors.update({k.removesuffix(".weight") + f".{leaf}": torch.ones(())
                    for k, v in bfl.items() if v.dim() == 2})
    file = write(tmp_path / "flux1-tiny-fp8-scaled.safetensors", tensors)
    with pytest.raises(CheckpointMismatchError, match=rf"scaled fp8 checkpoint .*\.{leaf}'.*plain "
                                                      r"fp8 one"):
        shuttle_diffusers.from_pretrained(root, device="cpu", weights={"transformer": file})
