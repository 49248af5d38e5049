"""examples/dynamic_adapters.py runs: two PEFT-written adapters attached at forward time match
the merged one, a swap changes the output, and detaching gives the model back bit for bit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("peft")


def test_the_dynamic_adapters_example_runs_and_checks_out():
    path = Path(__file__).resolve().parents[2] / "examples" / "dynamic_adapters.py"
    spec = importlib.util.spec_from_file_location("dynamic_adapters_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    checks = example.main(["--device", "cpu", "--dim", "64", "--tokens", "32"])
    assert checks["dynamic vs merged"] < 1e-4
    assert checks["swap changed the output"] > 1e-2
    assert checks["detached vs base"] == 0
