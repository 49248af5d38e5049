"""Diag-OFT patches: the rotation and its strength, the row scale, shapes, and the kohya/comfy
spelling read back (LyCORIS's own files: tests/apply/test_oracle_lycoris.py)."""

from __future__ import annotations

import pytest
import torch

import shuttle
from shuttle.errors import AdapterFormatError, ShapeMismatchError
from shuttle.patches import OFT
from tests import close

K, B, IN = 3, 4, 5


def _oft(rescale: bool = False, alpha: float = 0.0) -> OFT:
    g = torch.Generator().manual_seed(0)
    return OFT("weight", blocks=0.3 * torch.randn(K, B, B, generator=g),
               rescale=1 + 0.1 * torch.randn(K * B, 1, generator=g) if rescale else None,
               alpha_value=alpha)


def test_a_rotation_keeps_each_blocks_column_norms_and_strength_zero_keeps_the_weight():
    w = torch.randn(K * B, IN)
    p = _oft()
    rotated = p.apply(w.clone(), 1.0)
    close(rotated.reshape(K, B, IN).norm(dim=1), w.reshape(K, B, IN).norm(dim=1))
    assert not torch.allclose(rotated, w)
    assert torch.equal(p.apply(w.clone(), 0.0), w)


def test_strength_moves_rotation_and_row_scale_on_a_line():
    w = torch.randn(K * B, IN)
    p = _oft(rescale=True)
    r = p.rotation(K * B)
    m = torch.eye(B) + 0.5 * (r - torch.eye(B))
    want = torch.einsum("knm,knc->kmc", m, w.reshape(K, B, IN)).reshape(K * B, IN)
    want = want * (1 + 0.5 * (p.rescale - 1))
    close(p.apply(w.clone(), 0.5), want, rtol=1e-6, atol=1e-6)


def test_the_constraint_bounds_the_generator():
    """alpha * out bounds ||Q||: a small alpha gives a rotation near the identity."""
    tight = _oft(alpha=1e-4).rotation(K * B)
    eye = torch.eye(B).expand(K, B, B)
    assert (tight - eye).norm() < 1e-2 < (_oft().rotation(K * B) - eye).norm()


def test_a_weight_of_other_rows_is_refused():
    with pytest.raises(ShapeMismatchError, match="rotates 12 output rows"):
        _oft().check((K * B + 1, IN), "w")
    _oft(rescale=True).check((K * B, IN, 3, 3), "w")


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_a_written_oft_reads_back_as_the_same_patch(to, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(IN, K * B))
    lora = shuttle.LoRA("lycoris", {"0": [_oft(rescale=True, alpha=0.5)]}, "<test>")
    path = tmp_path / "oft.safetensors"
    shuttle.save_lora(lora, path, to=to)
    back = shuttle.load_lora(path)
    (patch,), = back.modules.values()
    assert isinstance(patch, OFT) and patch.alpha == 0.5
    a, b = model.state_dict()["0.weight"].clone(), model.state_dict()["0.weight"].clone()
    torch.testing.assert_close(patch.load().apply(a, 0.7), lora.modules["0"][0].apply(b, 0.7))


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (4, 4, 3), (2, 4, 3, 3), (4, 4)])
def test_blocks_of_no_oft_shape_are_refused(shape, tmp_path):
    from safetensors.torch import save_file

    save_file({"lycoris_lin.oft_blocks": torch.zeros(shape)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(AdapterFormatError, match="OFT blocks"):
        shuttle.load_lora(tmp_path / "a.safetensors")
