"""The test suite. Shared helpers live here (imported as ``from tests import ...``); test modules
mirror the package tree.

``lowrank_state``: PEFT-keyed low-rank factors for named modules, from one seeded generator.
``close``: float64 comparison with a tolerance; ``assert_bits_equal``: bit for bit (NaN
payloads and -0 too).
``snapshot`` / ``assert_unchanged``: a model's parameters before a call that must not change
them, and the check after it.
``RecordedBar``: a stand-in for tqdm that records what a progress bar is told.
"""

from __future__ import annotations

import torch


def lowrank_state(shapes: dict[str, tuple[int, int]], rank: int = 4, scale: float = 0.1,
                  seed: int = 5, generator: torch.Generator | None = None
                  ) -> dict[str, torch.Tensor]:
    """``<module>.lora_A.weight`` (rank, in) and ``.lora_B.weight`` (out, rank) per module of
    ``shapes`` (``module -> (out, in)``), drawn A then B, module by module, scaled by ``scale``.

    ``generator``, if given, is drawn from (and advanced) instead of a new one seeded ``seed``.
    """
    g = generator or torch.Generator().manual_seed(seed)
    sd = {}
    for m, (out_f, in_f) in shapes.items():
        sd[f"{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * scale
        sd[f"{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * scale
    return sd


# same-width integer views, for bit-for-bit comparison of any float dtype (float8 included)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5,
          atol: float = 1e-5) -> None:
    """``actual`` equals ``expected`` within the tolerances, compared in float64."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (so -0.0 != 0.0 and NaN payloads count)."""
    return t.detach().cpu().contiguous().view(_BITS[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits; the message counts and shows the first differences."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    diff = bits(actual) != bits(expected)
    assert not diff.any(), (
        f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first: "
        f"{actual.flatten()[diff.flatten()][:4].tolist()} vs "
        f"{expected.flatten()[diff.flatten()][:4].tolist()}"
    )


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    """The model has the parameters of ``before``, bit for bit."""
    params = dict(model.named_parameters())
    assert params.keys() == before.keys()
    for n, saved in before.items():
        assert_bits_equal(params[n], saved, n)


def load_example(name: str):
    """The module ``examples/<name>.py``, imported from its file (examples are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordedBar:
    """tqdm's part that a capture's progress bar uses, recording what it is told."""

    bars: list[RecordedBar] = []

    def __init__(self, total, **kw):
        self.total, self.n, self.desc = total, 0, kw.get("desc")
        RecordedBar.bars.append(self)

    def update(self, n):
        self.n += n

    def refresh(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
