"""examples/dynamic_adapters.py runs: two PEFT-written adapters attached at forward time match
the merged one, a swap changes the output, and detaching gives the model back bit for bit."""

from __future__ import annotations

import pytest

from tests import load_example

pytest.importorskip("peft")


def test_the_dynamic_adapters_example_runs_and_checks_out():
    example = load_example("dynamic_adapters")
    checks = example.main(["--device", "cpu", "--dim", "64", "--tokens", "32"])
    assert checks["dynamic vs merged"] < 1e-4
    assert checks["swap changed the output"] > 1e-2
    assert checks["detached vs base"] == 0
