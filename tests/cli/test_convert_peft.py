"""``shuttle convert PIPELINE_FILE DIR --to peft``: a diffusers pipeline file becomes a PEFT
directory that PEFT itself loads (issue 37, item 4).

The file is written by diffusers' own ``save_lora_weights`` from a PEFT adapter on a tiny model
(keys ``transformer.<module>.lora_A.weight``, the config per component in the header). PEFT's
``PeftModel.from_pretrained`` loads the converted directory onto a fresh copy of the model; its
outputs must equal the trained PEFT model's and shuttle's own application of the source file.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from torch import nn

import shuttle
from shuttle.cli import main

peft = pytest.importorskip("peft")
lora_pipeline = pytest.importorskip("diffusers.loaders.lora_pipeline")


class Tiny(nn.Module):
    """Two blocks of q/k projections: module paths ``blocks.<i>.to_q`` as in a transformer."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"to_q": nn.Linear(8, 8), "to_k": nn.Linear(8, 8)}) for _ in range(2))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b["to_q"](x) + b["to_k"](x).tanh()
        return x


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _trained(base: nn.Module, **config) -> tuple[nn.Module, dict[str, torch.Tensor], dict]:
    """A copy of ``base`` with a PEFT LoRA of non-zero factors; its state dict and config."""
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(base)
    cfg = peft.LoraConfig(init_lora_weights=False, target_modules=["to_q", "to_k"], **config)
    peft.inject_adapter_in_model(cfg, model)
    return model, get_peft_model_state_dict(model), cfg.to_dict()


@pytest.fixture
def pipeline_file(tmp_path):
    """A Flux pipeline LoRA file on a transformer and a text encoder (both ``Tiny``), with
    alpha != r and a rank pattern, as diffusers' training scripts save it.
    """
    bases = {"transformer": Tiny(0), "text_encoder": Tiny(1)}
    tuned_t, sd_t, cfg_t = _trained(bases["transformer"], r=2, lora_alpha=6,
                                    rank_pattern={"blocks.1.to_k": 4})
    tuned_e, sd_e, cfg_e = _trained(bases["text_encoder"], r=3, lora_alpha=2)
    lora_pipeline.FluxLoraLoaderMixin.save_lora_weights(
        tmp_path / "both", transformer_lora_layers=sd_t, text_encoder_lora_layers=sd_e,
        transformer_lora_adapter_metadata=cfg_t, text_encoder_lora_adapter_metadata=cfg_e)
    lora_pipeline.FluxLoraLoaderMixin.save_lora_weights(
        tmp_path / "one", transformer_lora_layers=sd_t, transformer_lora_adapter_metadata=cfg_t)
    tuned = {"transformer": tuned_t, "text_encoder": tuned_e}
    return tmp_path, bases, tuned


def _check_loads_in_peft(out, bases: dict[str, nn.Module], tuned: nn.Module, source,
                         component: str) -> None:
    config = json.loads((out / "adapter_config.json").read_text())
    assert not any(m.startswith(f"{component}.") for m in config["target_modules"]), config
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(bases[component]), str(out))
    # shuttle's merge of the source file into a pipeline of fresh components
    pipe = nn.Module()
    for name, base in bases.items():
        pipe.add_module(name, copy.deepcopy(base))
    shuttle.merge_lora(pipe, [(shuttle.load_lora(source), 1.0)])
    ours = pipe.get_submodule(component)
    with torch.no_grad():
        want = tuned(x)
        torch.testing.assert_close(loaded(x), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-12)


def test_one_component_converts_to_a_directory_peft_loads(pipeline_file, capsys):
    tmp, bases, tuned = pipeline_file
    source = tmp / "one" / "pytorch_lora_weights.safetensors"
    assert main(["convert", str(source), str(tmp / "out"), "--to", "peft"]) == 0
    assert "4 modules of component 'transformer'" in capsys.readouterr().out
    _check_loads_in_peft(tmp / "out", bases, tuned["transformer"], source, "transformer")


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_several_components_convert_one_at_a_time(pipeline_file, capsys, component):
    tmp, bases, tuned = pipeline_file
    source = tmp / "both" / "pytorch_lora_weights.safetensors"
    assert main(["convert", str(source), str(tmp / "out"), "--to", "peft"]) == 2
    err = capsys.readouterr().err
    assert "text_encoder (4 modules), transformer (4 modules)" in err, err
    assert "--component NAME" in err and "Traceback" not in err
    assert not (tmp / "out").exists()

    assert main(["convert", str(source), str(tmp / "out"), "--to", "peft",
                 "--component", component]) == 0
    other = {"transformer": "text_encoder", "text_encoder": "transformer"}[component]
    assert f"left out 4 modules of {other} (--component {other} writes them)" in \
        capsys.readouterr().out
    _check_loads_in_peft(tmp / "out", bases, tuned[component], source, component)


@pytest.mark.parametrize(("source", "argv", "match"), [
    ("both", ["--to", "peft", "--component", "unet"],
     "component='unet': the adapter has modules of text_encoder (4 modules), transformer"),
    ("both", ["--to", "comfy", "--component", "transformer"], "is for to='peft'"),
    ("peft", ["--to", "peft", "--component", "transformer"],
     "no pipeline components (its keys are one model's)"),
])
def test_a_wrong_component_is_refused(pipeline_file, capsys, source, argv, match):
    tmp, _, _ = pipeline_file
    if source == "peft":
        assert main(["convert", str(tmp / "one" / "pytorch_lora_weights.safetensors"),
                     str(tmp / "peft"), "--to", "peft"]) == 0
        path = tmp / "peft"
    else:
        path = tmp / source / "pytorch_lora_weights.safetensors"
    out = tmp / ("x.safetensors" if "comfy" in argv else "x")
    assert main(["convert", str(path), str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err
    assert not out.exists()
