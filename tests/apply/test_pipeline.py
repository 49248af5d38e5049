"""merge_lora / apply_lora / attach_lora on a diffusers pipeline, and strengths per component."""

from __future__ import annotations

import copy

import pytest
import torch

import shuttle
from shuttle.errors import InvalidStrengthError, UnsupportedModelError
from tests.integrations.models import flux_lora, tiny_flux

pytest.importorskip("diffusers")


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _expected(pipe, lora, strengths: dict[str, float]) -> dict[str, dict[str, torch.Tensor]]:
    """Each component merged on its own copy at its strength (keys of other components are
    unmatched there)."""
    out = {}
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        component = copy.deepcopy(getattr(pipe, name))
        s = strengths.get(name, 1.0)
        if s:
            shuttle.merge_lora(component, [(lora, s)])
        out[name] = _state(component)
    return out


def _assert_states(pipe, want):
    for name, state in want.items():
        got = _state(getattr(pipe, name))
        for k, v in state.items():
            assert torch.equal(got[k], v), f"{name}.{k}"


def test_a_pipeline_merge_routes_each_key_to_its_component():
    pipe, lora = tiny_flux(), flux_lora()
    want = _expected(pipe, lora, {"transformer": 0.7, "text_encoder": 0.7})
    report = shuttle.merge_lora(pipe, [(lora, 0.7)], strict=True)
    assert report.unmatched == {}
    assert {n.split(".")[0] for n in report.applied} == {"transformer", "text_encoder"}
    _assert_states(pipe, want)


def test_strengths_per_component():
    pipe, lora = tiny_flux(), flux_lora()
    want = _expected(pipe, lora, {"transformer": 0.5, "text_encoder": 0.0})
    report = shuttle.merge_lora(pipe, [(lora, {"transformer": 0.5, "text_encoder": 0.0})])
    assert {n.split(".")[0] for n in report.applied} == {"transformer"}
    _assert_states(pipe, want)


def test_a_scoped_pipeline_merge_restores_every_component():
    pipe, lora = tiny_flux(), flux_lora()
    before = {n: _state(getattr(pipe, n)) for n in ("transformer", "text_encoder")}
    want = _expected(pipe, lora, {"text_encoder": 2.0})  # the transformer at 1, not named
    with shuttle.apply_lora(pipe, [(lora, {"text_encoder": 2.0})]):
        _assert_states(pipe, {n: want[n] for n in before})
    _assert_states(pipe, before)


@pytest.mark.parametrize(("call", "error", "why"), [
    (lambda pipe, lora: shuttle.merge_lora(pipe, [(lora, {"unet": 0.5})]),
     InvalidStrengthError, r"names \['unet'\] that the model does not have"),
    (lambda pipe, lora: shuttle.merge_lora(pipe, [(lora, {"transformer": float("nan")})]),
     InvalidStrengthError, r"strength\['transformer'\]"),
    (lambda pipe, lora: shuttle.attach_lora(pipe, [(lora, {"transformer": 0.5})]),
     InvalidStrengthError, "dynamic adapters hold one strength per adapter"),
    (lambda pipe, lora: shuttle.merge_lora(object(), [(lora, 1.0)]),
     UnsupportedModelError, "expected an nn.Module or a diffusers pipeline"),
])
def test_bad_calls_name_the_problem_and_change_nothing(call, error, why):
    pipe, lora = tiny_flux(), flux_lora()
    before = {n: _state(getattr(pipe, n)) for n in ("transformer", "text_encoder")}
    with pytest.raises(error, match=why):
        call(pipe, lora)
    _assert_states(pipe, before)
