"""examples/train_lora.py runs: a LoRA trained under shuttle.train on a tiny Llama and a tiny
Flux-shaped DiT, saved as PEFT and kohya files, loaded back and merged, equals the trained
model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("diffusers")


def test_the_training_example_runs_and_its_merged_models_equal_the_trained_ones():
    path = Path(__file__).resolve().parents[2] / "examples" / "train_lora.py"
    spec = importlib.util.spec_from_file_location("train_lora_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    errors = example.main(["--steps", "2"])
    assert set(errors) == {"llama", "flux-dit"}
    assert all(e < 1e-5 for e in errors.values()), errors
