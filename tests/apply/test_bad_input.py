"""Bad input gives a typed error from shuttle.errors, and the model stays as it was, bit for bit.

Every adapter here also carries a valid update for a parameter that comes first in merge order,
so a merge that wrote before validating everything would show up as a changed hash.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import (
    AdapterFormatError,
    DuplicateTargetError,
    InvalidOptionError,
    InvalidStrengthError,
    NonFiniteAdapterError,
    ShapeMismatchError,
    ShuttleError,
    UnknownKeyError,
    UnsupportedFormatError,
    UnsupportedLayerError,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 6)
        self.second = nn.Linear(6, 4)
        self.conv = nn.Conv2d(3, 5, 3)


def model_hash(model: nn.Module) -> dict[str, str]:
    """sha256 of every parameter's and buffer's bytes, with its dtype and shape."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        raw = b"" if t.is_meta else (
            t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        head = f"{t.dtype}{tuple(t.shape)}{t.device}".encode()
        out[name] = hashlib.sha256(head + raw).hexdigest()
    return out


def good(g: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """A valid update of ``first.weight`` (merged before anything else)."""
    g = g or torch.Generator().manual_seed(0)
    return {"first.lora_A.weight": torch.randn(2, 8, generator=g),
            "first.lora_B.weight": torch.randn(6, 2, generator=g)}


def second(rank: int = 2, out: int = 4, inp: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"second.lora_A.weight": torch.randn(rank, inp, generator=g),
            "second.lora_B.weight": torch.randn(out, rank, generator=g)}


def expect_unchanged(model: nn.Module, error: type[ShuttleError], loras, **kw) -> ShuttleError:
    """Both merge_lora and apply_lora raise ``error`` and leave ``model`` untouched."""
    before = model_hash(model)
    with pytest.raises(error) as info:
        shuttle.merge_lora(model, loras, **kw)
    assert model_hash(model) == before
    with pytest.raises(error), shuttle.apply_lora(model, loras, **kw):
        pytest.fail("the body must not run")
    assert model_hash(model) == before
    assert str(info.value), "the message must say what is wrong"
    return info.value


# -- strengths ------------------------------------------------------------------------------------

@pytest.mark.parametrize("strength", [
    math.nan, math.inf, -math.inf, torch.tensor(math.nan), torch.tensor(math.inf),
    "0.5", None, 1 + 0j, [1.0], torch.tensor([1.0, 2.0]), object(),
], ids=["nan", "inf", "-inf", "tensor-nan", "tensor-inf", "str", "none", "complex", "list",
        "tensor-2", "object"])
def test_bad_strength(strength):
    model = Net()
    err = expect_unchanged(model, InvalidStrengthError, [(good(), 1.0), (second(), strength)])
    assert "loras[1]" in str(err)


@pytest.mark.parametrize("loras", [
    [good()], [(good(),)], [(good(), 1.0, 2.0)], [[good(), 1.0]],
], ids=["bare-dict", "1-tuple", "3-tuple", "list-pair"])
def test_malformed_adapter_list(loras):
    expect_unchanged(Net(), InvalidStrengthError, loras)


def test_bad_rounding_mode():
    expect_unchanged(Net(), InvalidOptionError, [(good(), 1.0)], rounding="up")


# -- shapes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    second(out=5),                    # update has 5 rows, parameter 4
    second(inp=7),                    # 7 input columns, parameter 6
    {"second.lora_A.weight": torch.randn(3, 6),   # ranks differ: (4, 2) @ (3, 6)
     "second.lora_B.weight": torch.randn(4, 2)},
    {"second.diff": torch.randn(4, 7)},
    {"second.diff_b": torch.randn(5)},
    {"second.set_weight": torch.randn(6, 4)},
    {"second.lora_A.weight": torch.randn(2, 6), "second.lora_B.weight": torch.randn(4, 2),
     "second.lora_B.bias": torch.randn(3)},
    {"lycoris_second.hada_w1_a": torch.randn(4, 2), "lycoris_second.hada_w1_b": torch.randn(2, 6),
     "lycoris_second.hada_w2_a": torch.randn(4, 2), "lycoris_second.hada_w2_b": torch.randn(3, 6)},
    {"lycoris_second.hada_w1_a": torch.randn(4, 2), "lycoris_second.hada_w1_b": torch.randn(2, 6),
     "lycoris_second.hada_w2_a": torch.randn(2, 2), "lycoris_second.hada_w2_b": torch.randn(2, 12)},
    {"lycoris_second.lokr_w1": torch.randn(2, 2), "lycoris_second.lokr_w2_a": torch.randn(2, 3),
     "lycoris_second.lokr_w2_b": torch.randn(2, 3)},
    {"lycoris_second.lokr_w1": torch.randn(2, 3), "lycoris_second.lokr_w2": torch.randn(2, 3)},
    {"second.lora_A.weight": torch.randn(2, 6), "second.lora_B.weight": torch.randn(4, 2),
     "second.lora_magnitude_vector": torch.rand(5)},
    {"lycoris_second.weight": torch.randn(5), "lycoris_second.on_input": torch.tensor(False)},
], ids=["rows", "cols", "rank", "diff", "diff_b", "set", "up-bias", "loha-rank", "loha-products",
        "lokr-rank", "lokr-size", "dora-magnitude", "ia3"])
def test_shape_mismatch(bad):
    err = expect_unchanged(Net(), ShapeMismatchError, [({**good(), **bad}, 1.0)])
    assert "second" in str(err)


def test_shape_mismatch_in_a_later_adapter():
    expect_unchanged(Net(), ShapeMismatchError, [(good(), 1.0), (second(out=3), 0.5)])


def test_conv_shape_mismatch():
    bad = {"lora_unet_conv.lora_down.weight": torch.randn(2, 3, 5, 5),
           "lora_unet_conv.lora_up.weight": torch.randn(5, 2, 1, 1)}
    expect_unchanged(Net(), ShapeMismatchError, [({**good(), **bad}, 1.0)])


def test_split_rows_that_do_not_fit_a_fused_weight():
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.qkv = nn.Linear(4, 12)
    g = torch.Generator().manual_seed(2)
    sd = {"attn.to_q.lora_A.weight": torch.randn(1, 4, generator=g),
          "attn.to_q.lora_B.weight": torch.randn(4, 1, generator=g),
          "attn.to_k.lora_A.weight": torch.randn(1, 4, generator=g),
          "attn.to_k.lora_B.weight": torch.randn(5, 1, generator=g)}  # k is 5 rows of 4
    expect_unchanged(model, ShapeMismatchError, [(sd, 1.0)])


# -- duplicate targets ----------------------------------------------------------------------------

def test_two_keys_onto_one_parameter():
    dup = {f"transformer.{k}": v for k, v in second().items()}  # the prefix is stripped
    err = expect_unchanged(Net(), DuplicateTargetError, [({**good(), **second(), **dup}, 1.0)])
    assert "second.weight" in str(err)


def test_two_splits_onto_overlapping_rows():
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.qkv = nn.Linear(4, 12)
    g = torch.Generator().manual_seed(3)
    sd = {"attn.qkv.lora_A.weight": torch.randn(1, 4, generator=g),
          "attn.qkv.lora_B.weight": torch.randn(12, 1, generator=g),
          "attn.to_v.lora_A.weight": torch.randn(1, 4, generator=g),
          "attn.to_v.lora_B.weight": torch.randn(4, 1, generator=g)}
    expect_unchanged(model, DuplicateTargetError, [(sd, 1.0)])


def test_the_same_adapter_twice_is_not_a_duplicate():
    model = Net()
    report = shuttle.merge_lora(model, [(good(), 0.5), (good(), 0.5)])
    assert report.applied == ["first.weight"]


# -- non-finite adapter tensors -------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["second.lora_A.weight", "second.lora_B.weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_non_finite_adapter_tensor(where, value, dtype):
    sd = {**good(), **second()}
    sd = {k: v.to(dtype) for k, v in sd.items()}
    sd[where] = sd[where].clone()
    sd[where][0, -1] = value
    err = expect_unchanged(Net(), NonFiniteAdapterError, [(sd, 1.0)])
    assert "second" in str(err)


def test_non_finite_dense_and_magnitude_tensors():
    for bad in ({"second.diff": torch.full((4, 6), math.nan)},
                {"second.diff_b": torch.tensor([0.0, math.inf, 0.0, 0.0])},
                {**second(), "second.lora_magnitude_vector": torch.tensor([1.0, math.nan, 1, 1])}):
        expect_unchanged(Net(), NonFiniteAdapterError, [({**good(), **bad}, 1.0)])


def test_nan_alpha_is_a_format_error():
    sd = {"lora_unet_second.lora_down.weight": torch.randn(2, 6),
          "lora_unet_second.lora_up.weight": torch.randn(4, 2),
          "lora_unet_second.alpha": torch.tensor(math.nan)}
    expect_unchanged(Net(), AdapterFormatError, [(good(), 1.0), (sd, 1.0)])


def test_merge_that_overflows_the_weight_dtype_changes_nothing():
    model = Net().half()
    sd = {"first.lora_A.weight": torch.full((1, 8), 300.0),
          "first.lora_B.weight": torch.full((6, 1), 300.0)}
    expect_unchanged(model, NonFiniteAdapterError, [(sd, 1.0)])


# -- unknown keys and unsupported formats ---------------------------------------------------------

@pytest.mark.parametrize("extra", [
    {"second.frobnicate.weight": torch.randn(4, 6)},
    {"model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4)},  # a checkpoint, not an adapter
    {"second.lora_C.weight": torch.randn(2, 2)},
], ids=["made-up", "checkpoint", "lora_C"])
def test_unknown_key_kind(extra):
    err = expect_unchanged(Net(), UnknownKeyError, [(good(), 1.0), ({**second(), **extra}, 1.0)])
    assert next(iter(extra)) in str(err)


@pytest.mark.parametrize("extra", [
    {"lycoris_second.oft_diag": torch.randn(2, 2, 2)},
    {"lycoris_second.a1.weight": torch.randn(6, 2), "lycoris_second.a2.weight": torch.randn(2, 6),
     "lycoris_second.b1.weight": torch.randn(4, 2), "lycoris_second.b2.weight": torch.randn(2, 6)},
    {"second.oft_r": torch.randn(2, 3)},
    {"second.ia3_l": torch.randn(4)},
], ids=["kohya-oft", "glora", "peft-oft", "peft-ia3"])
def test_unsupported_format_keys(extra):
    expect_unchanged(Net(), UnsupportedFormatError, [(good(), 1.0), ({**good(), **extra}, 1.0)])


@pytest.mark.parametrize("peft_type", ["OFT", "IA3", "VERA", "BOFT"])
def test_unsupported_peft_type(tmp_path, peft_type):
    import json

    from safetensors.torch import save_file

    save_file({f"base_model.model.{k}": v.contiguous() for k, v in second().items()},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": 2}))
    err = expect_unchanged(Net(), UnsupportedFormatError, [(good(), 1.0), (tmp_path, 1.0)])
    assert peft_type in str(err)


def test_non_tensor_values_in_a_state_dict():
    expect_unchanged(Net(), AdapterFormatError, [(good(), 1.0), ({**second(), "x": 1.0}, 1.0)])


def test_a_factor_without_its_partner():
    sd = {"second.lora_A.weight": torch.randn(2, 6)}
    expect_unchanged(Net(), AdapterFormatError, [(good(), 1.0), (sd, 1.0)])


@pytest.mark.parametrize("shape", [(), (6,)], ids=["0-d", "1-d"])
def test_a_factor_that_is_not_a_matrix(shape):
    sd = {"second.lora_A.weight": torch.randn(shape), "second.lora_B.weight": torch.randn(4, 1)}
    expect_unchanged(Net(), AdapterFormatError, [(good(), 1.0), (sd, 1.0)])


def test_missing_file():
    expect_unchanged(Net(), shuttle.errors.AdapterFileError,
                     [(good(), 1.0), ("/nonexistent/adapter.safetensors", 1.0)])


# -- layers that cannot take a merge --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.bool], ids=str)
def test_integer_dtype_parameter(dtype):
    model = Net()
    model.second.weight = nn.Parameter(torch.zeros(4, 6, dtype=dtype), requires_grad=False)
    err = expect_unchanged(model, UnsupportedLayerError, [({**good(), **second()}, 1.0)])
    assert "second.weight" in str(err)


def test_meta_device_parameter():
    model = Net()
    model.second.weight = nn.Parameter(torch.empty(4, 6, device="meta"))
    err = expect_unchanged(model, UnsupportedLayerError, [({**good(), **second()}, 1.0)])
    # The fix it names is one merge_lora's caller can take (merge_lora has no device=).
    assert "second.weight" in str(err) and "load_checkpoint" in str(err)
    assert "device=" not in str(err)


# -- harmless keys are reported, not fatal --------------------------------------------------------

def test_alpha_without_factors_is_skipped_and_reported():
    sd = {"lora_unet_second.lora_down.weight": torch.randn(2, 6),
          "lora_unet_second.lora_up.weight": torch.randn(4, 2),
          "lora_unet_second.alpha": torch.tensor(2.0),
          "lora_unet_first.alpha": torch.tensor(4.0)}  # alpha alone: nothing to apply
    lora = shuttle.load_lora(sd)
    assert lora.skipped == {"lora_unet_first.alpha": lora.skipped["lora_unet_first.alpha"]}
    assert "alpha" in lora.skipped["lora_unet_first.alpha"]
    model = Net()
    before = model_hash(model)
    report = shuttle.merge_lora(model, [(lora, 1.0)])
    assert report.applied == ["second.weight"]
    assert report.skipped == lora.skipped
    assert report.unmatched == {}
    after = model_hash(model)
    assert {n for n in before if before[n] != after[n]} == {"second.weight"}


def test_skipped_keys_of_several_adapters_name_their_source():
    a = {**second(), "lora_unet_conv.alpha": torch.tensor(1.0)}
    report = shuttle.merge_lora(Net(), [(good(), 1.0), (a, 1.0)])
    assert report.skipped == {"<state dict>::lora_unet_conv.alpha": report.skipped[
        "<state dict>::lora_unet_conv.alpha"]}


def test_unknown_keys_with_strict_false_are_skipped_and_reported():
    sd = {**second(), "second.frobnicate.weight": torch.randn(4, 6)}
    lora = shuttle.load_lora(sd, strict=False)
    assert list(lora.skipped) == ["second.frobnicate.weight"]
    report = shuttle.merge_lora(Net(), [(lora, 1.0)])
    assert report.applied == ["second.weight"]
    assert list(report.skipped) == ["second.frobnicate.weight"]
