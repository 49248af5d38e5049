"""The registry and the operations derived from ``tensor_names``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shuttle.errors import ShuttleError, UnmergeableWeightError
from shuttle.weights import (
    REPRESENTATIONS,
    Fp8Weight,
    PlainWeight,
    WeightRepresentation,
    register_representation,
    represent,
)


@pytest.fixture
def registry():
    saved = dict(REPRESENTATIONS)
    yield REPRESENTATIONS
    REPRESENTATIONS.clear()
    REPRESENTATIONS.update(saved)


@dataclasses.dataclass
class RowInt8(WeightRepresentation):
    """A user's own form: int8 rows with a float32 scale per row."""

    qdata: torch.Tensor
    scale: torch.Tensor

    tensor_names = ("qdata", "scale")

    @property
    def logical_shape(self) -> torch.Size:
        return self.qdata.shape

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32

    def dequantize(self) -> torch.Tensor:
        return self.qdata.float() * self.scale.unsqueeze(1)

    def encode(self, x, rounding="nearest", generator=None):
        scale = x.abs().amax(dim=1).clamp(min=1e-12) / 127
        return RowInt8(torch.round(x / scale.unsqueeze(1)).to(torch.int8), scale)

    @classmethod
    def accepts(cls, tensor):
        return tensor.dtype == torch.int8

    @classmethod
    def from_tensor(cls, tensor):
        return cls(tensor, torch.ones(tensor.shape[0]))


def test_builtin_detection():
    assert {"plain", "fp8", "gguf"} <= REPRESENTATIONS.keys()
    assert isinstance(represent(torch.zeros(2, dtype=torch.bfloat16)), PlainWeight)
    assert isinstance(represent(torch.zeros(2, dtype=torch.float8_e5m2)), Fp8Weight)
    rep = PlainWeight(torch.zeros(2))
    assert represent(rep) is rep
    with pytest.raises(ShuttleError, match="register_representation"):
        represent(torch.zeros(2, dtype=torch.int8))


def test_user_representation(registry):
    register_representation("row-int8")(RowInt8)
    w = torch.randn(4, 8)
    rep = represent(torch.zeros(4, 8, dtype=torch.int8))
    assert isinstance(rep, RowInt8)
    enc = rep.encode(w)
    torch.testing.assert_close(enc.dequantize(), w, atol=w.abs().max().item() / 127, rtol=0)
    # derived from tensor_names: bytes, copies, pinning keep the class and both tensors
    assert enc.nbytes == 4 * 8 + 4 * 4
    assert set(enc.tensors()) == {"qdata", "scale"}
    moved = enc.to("meta")
    assert isinstance(moved, RowInt8) and moved.qdata.device.type == "meta"
    assert moved.scale.device.type == "meta"
    assert isinstance(enc.pin(), RowInt8)


def test_registration_errors(registry):
    register_representation("row-int8")(RowInt8)
    with pytest.raises(ShuttleError, match="registered already"):
        register_representation("row-int8")(RowInt8)
    with pytest.raises(ShuttleError, match="subclass"):
        register_representation("nope")(dict)


def test_base_encode_is_unmergeable():
    @dataclasses.dataclass
    class Frozen(WeightRepresentation):
        blob: torch.Tensor
        tensor_names = ("blob",)
        mergeable = False

    with pytest.raises(UnmergeableWeightError, match="dynamic"):
        Frozen(torch.zeros(1)).encode(torch.zeros(1))
    assert Frozen(torch.zeros(3)).nbytes == 12


class _State:
    """A library's side object (as bitsandbytes' QuantState): tensors one attribute deep."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale


class _Packed(torch.Tensor):
    """A library's parameter: int8 codes as its data, a scale on a side object, a mirror."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor):
        t = torch.Tensor._make_subclass(cls, codes)
        t.state, t.mirror = _State(scale), codes
        return t


@dataclasses.dataclass
class _PackedWeight(WeightRepresentation):
    tensor_names = ("codes", "scale")
    param_attrs = {"codes": ("data", "mirror"), "scale": "state.scale"}
    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def logical_shape(self) -> torch.Size:
        return self.codes.shape

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> _PackedWeight:
        return cls(tensor.data, tensor.state.scale)


def _packed(seed: int) -> _Packed:
    g = torch.Generator().manual_seed(seed)
    return _Packed(torch.randint(-100, 100, (4, 6), generator=g, dtype=torch.int8),
                   torch.rand(4, generator=g))


def test_write_into_and_rebind_are_derived_from_param_attrs():
    param, other = _packed(0), _packed(1)
    codes, scale = param.data, param.state.scale
    _PackedWeight.from_tensor(other).write_into(param)
    assert torch.equal(param.data, other.data) and torch.equal(param.state.scale,
                                                                 other.state.scale)
    assert param.state.scale is scale and param.data.data_ptr() == codes.data_ptr()  # in place
    new = {"codes": torch.zeros(4, 6, dtype=torch.int8), "scale": torch.ones(4)}
    _PackedWeight.from_tensor(param).rebind(param, new)
    assert param.state.scale is new["scale"]  # a nested attribute path
    assert param.mirror is new["codes"] and param.data.data_ptr() == new["codes"].data_ptr()


def test_write_into_refuses_another_form_and_changes_nothing():
    from shuttle.errors import UnsupportedLayerError

    param = _packed(0)
    before = param.data.clone()
    wide = _Packed(torch.zeros(4, 8, dtype=torch.int8), torch.rand(4))
    with pytest.raises(UnsupportedLayerError, match="another form"):
        _PackedWeight.from_tensor(wide).write_into(param)
    assert torch.equal(param.data, before)


def test_without_param_attrs_nothing_is_derived():
    rep = PlainWeight(torch.zeros(3))
    assert rep.writable
    assert not RowInt8(torch.zeros(2, 2, dtype=torch.int8), torch.ones(2)).writable
    with pytest.raises(NotImplementedError, match="param_attrs"):
        RowInt8(torch.zeros(2, 2, dtype=torch.int8), torch.ones(2)).rebind(
            torch.zeros(2), {})
