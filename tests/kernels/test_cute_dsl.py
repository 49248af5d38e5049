"""The CuTe DSL's import: an optional dependency whose absence names the extra."""

from __future__ import annotations

import pytest

from shuttle.kernels.cute_dsl import dsl


def test_a_missing_dsl_names_the_extra(monkeypatch):
    import sys

    from shuttle.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "cutlass", None)  # import cutlass -> ImportError
    with pytest.raises(MissingDependencyError, match=r"shuttle\[hopper\]"):
        dsl.__wrapped__()
