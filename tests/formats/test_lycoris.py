"""Which strength rule a ``dora_scale`` gets: LyCORIS's for files LyCORIS wrote, else ComfyUI's,
or the caller's choice (``load_lora(dora=...)``, ``LoRA.with_dora``), kept by ``save_lora``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import shuttle
from shuttle.errors import AdapterFormatError, ShuttleError, UnsupportedFormatError
from shuttle.formats.lycoris import DORA_RULE_KEY, written_by_lycoris
from shuttle.patches import DoRA


def dora_file(prefix: str, *, loha: bool = False) -> dict[str, torch.Tensor]:
    m = f"{prefix}fc1"
    if loha:
        sd = {f"{m}.hada_w1_a": torch.randn(8, 2), f"{m}.hada_w1_b": torch.randn(2, 4),
              f"{m}.hada_w2_a": torch.randn(8, 2), f"{m}.hada_w2_b": torch.randn(2, 4)}
    else:
        sd = {f"{m}.lora_up.weight": torch.randn(8, 2), f"{m}.lora_down.weight": torch.randn(2, 4)}
    return {**sd, f"{m}.alpha": torch.tensor(1.0), f"{m}.dora_scale": torch.rand(8, 1) + 0.5}


def modes(lora: shuttle.LoRA) -> set[str]:
    return {p.mode for _, p in lora.patches() if isinstance(p, DoRA)}


def save(tmp_path, sd, metadata=None, name="a.safetensors"):
    path = tmp_path / name
    save_file(sd, str(path), metadata=metadata)
    return path


def test_signs_of_lycoris():
    assert written_by_lycoris(["lycoris_fc1.lora_up.weight"], {})
    assert written_by_lycoris(["lora_unet_fc1.lora_up.weight"],
                              {"ss_network_module": "lycoris.kohya"})
    assert not written_by_lycoris(["lora_unet_fc1.lora_up.weight"],
                                  {"ss_network_module": "networks.lora"})
    assert not written_by_lycoris(["lora_unet_fc1.hada_w1_a"], {})  # LoHa alone is no sign


@pytest.mark.parametrize("loha", [False, True], ids=["lora", "loha"])
def test_auto_rule(tmp_path, loha):
    assert modes(shuttle.load_lora(dora_file("lycoris_", loha=loha))) == {"lycoris"}
    assert modes(shuttle.load_lora(dora_file("lora_unet_", loha=loha))) == {"blend"}
    signed = save(tmp_path, dora_file("lora_unet_", loha=loha),
                  {"ss_network_module": "lycoris.kohya"})
    assert modes(shuttle.load_lora(signed)) == {"lycoris"}


def test_explicit_rule():
    assert modes(shuttle.load_lora(dora_file("lycoris_"), dora="comfy")) == {"blend"}
    kohya = shuttle.load_lora(dora_file("lora_unet_"), dora="lycoris")
    assert modes(kohya) == {"lycoris"}
    # on a LoRA already read: a copy, the original untouched
    back = shuttle.load_lora(kohya, dora="comfy")
    assert modes(back) == {"blend"} and modes(kohya) == {"lycoris"}
    assert shuttle.load_lora(kohya) is kohya
    assert kohya.with_dora("lycoris") is kohya


def test_peft_magnitude_is_left_alone():
    sd = {"base_model.model.fc1.lora_A.weight": torch.randn(2, 4),
          "base_model.model.fc1.lora_B.weight": torch.randn(8, 2),
          "base_model.model.fc1.lora_magnitude_vector": torch.rand(8) + 0.5}
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "use_dora": True,
           "target_modules": ["fc1"]}
    assert modes(shuttle.load_lora(sd, config=cfg, dora="lycoris")) == {"inner"}


@pytest.mark.parametrize("bad", ["LyCORIS", "peft", "inner", None])
def test_bad_rule(bad):
    with pytest.raises(ShuttleError, match="dora="):
        shuttle.load_lora(dora_file("lycoris_"), dora=bad)
    lora = shuttle.load_lora(dora_file("lycoris_"))
    with pytest.raises(ShuttleError, match="dora="):
        shuttle.load_lora(lora, dora=bad)
    with pytest.raises(ShuttleError, match="dora="):
        lora.with_dora(bad)


@pytest.mark.parametrize("to", ["kohya", "comfy"])
@pytest.mark.parametrize("rule", ["lycoris", "comfy"])
def test_save_keeps_the_rule(tmp_path, to, rule):
    # kohya names with no LyCORIS sign: only the recorded rule can bring "lycoris" back.
    lora = shuttle.load_lora(dora_file("lora_unet_"), dora=rule)
    out = shuttle.save_lora(lora, tmp_path / "out.safetensors", to=to)
    back = shuttle.load_lora(out)
    assert modes(back) == modes(lora) and back.metadata[DORA_RULE_KEY] == rule


def test_save_refuses_mixed_rules(tmp_path):
    one = shuttle.load_lora(dora_file("lora_unet_"), dora="lycoris")
    other = shuttle.load_lora({k.replace("fc1", "fc2"): v
                               for k, v in dora_file("lora_unet_").items()})
    mixed = shuttle.LoRA("kohya", {**one.modules, **other.modules})
    with pytest.raises(UnsupportedFormatError, match="with_dora"):
        shuttle.save_lora(mixed, tmp_path / "out.safetensors", to="kohya")
    assert not (tmp_path / "out.safetensors").exists()


def test_dora_scale_not_written_as_peft(tmp_path):
    lora = shuttle.load_lora(dora_file("lycoris_"))
    with pytest.raises(UnsupportedFormatError, match="dora_scale"):
        shuttle.save_lora(lora, tmp_path / "ad", to="peft")


def test_bad_recorded_rule(tmp_path):
    path = save(tmp_path, dora_file("lora_unet_"), {DORA_RULE_KEY: "sometimes"})
    with pytest.raises(AdapterFormatError, match=DORA_RULE_KEY):
        shuttle.load_lora(path)
    assert modes(shuttle.load_lora(path, dora="comfy")) == {"blend"}
