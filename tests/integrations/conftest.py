"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def plain():
    """(a pristine tiny FluxPipeline, its latents, its pixels), built once per module."""
    from tests.integrations.models import run_flux, tiny_flux

    pytest.importorskip("diffusers")
    pipe = tiny_flux()
    return pipe, run_flux(pipe), run_flux(pipe, "pt")
