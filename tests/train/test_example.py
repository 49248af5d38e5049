"""examples/train_lora.py runs: a LoRA trained under shuttle.train on a tiny Llama and a tiny
Flux-shaped DiT, saved as PEFT and kohya files, loaded back and merged, equals the trained
model."""

from __future__ import annotations

import pytest

from tests import load_example

pytest.importorskip("peft")
pytest.importorskip("diffusers")


def test_the_training_example_runs_and_its_merged_models_equal_the_trained_ones():
    example = load_example("train_lora")
    errors = example.main(["--steps", "2"])
    assert set(errors) == {"llama", "flux-dit"}
    assert all(e < 1e-5 for e in errors.values()), errors
