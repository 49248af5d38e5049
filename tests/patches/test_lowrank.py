"""LowRank: delta/apply/residual against float64 math written here, shapes, refs, registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shuttle.errors import ShapeMismatchError
from shuttle.patches import (
    IA3,
    PATCH_KINDS,
    Diff,
    DoRA,
    LoHa,
    LoKr,
    LowRank,
    Patch,
    Set,
    TensorRef,
    register_patch,
)
from shuttle.patches.lowrank import split_blocks

TOL = {"rtol": 1e-5, "atol": 1e-5}


def close(actual: torch.Tensor, expected: torch.Tensor, **tol) -> None:
    torch.testing.assert_close(actual.double(), expected, **(tol or TOL))


class Ref:
    """A TensorRef placeholder that counts how often its data is read."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.shape = t.shape
        self.dtype = t.dtype
        self.loads = 0

    def load(self) -> torch.Tensor:
        self.loads += 1
        return self._t


def ref_lowrank(up, down, scale, mid=None):
    """float64 delta of up (out, r, 1...) @ down (r, in, k...), Tucker core folded by einsum."""
    up64 = up.double().flatten(1)
    if mid is None:
        down64 = down.double()
        return scale * torch.einsum("o r, r i ... -> o i ...", up64, down64)
    down64 = down.double().flatten(1)  # (r, in)
    return scale * torch.einsum("i j ..., i p, j q -> p q ...", mid.double(), up64.T, down64)


# -- delta / apply ----------------------------------------------------------------------------


@pytest.mark.parametrize("out_f,in_f,r", [(7, 5, 3), (16, 16, 4), (3, 11, 1)])
def test_linear_delta_and_apply(out_f, in_f, r):
    up, down = torch.randn(out_f, r), torch.randn(r, in_f)
    alpha = 2.5
    p = LowRank("weight", up=up, down=down, scale=alpha / r, alpha_value=alpha)
    expected = ref_lowrank(up, down, alpha / r)
    close(p.delta((out_f, in_f)), expected)
    assert p.delta((out_f, in_f)).dtype == torch.float32

    w = torch.randn(out_f, in_f)
    out = p.apply(w.clone(), 0.7)
    close(out, w.double() + 0.7 * expected)
    assert p.rank == r and p.alpha == alpha and p.out_rows == out_f
    assert p.in_numel == in_f and p.out_features == out_f


def test_apply_bf16_factors_upcast():
    up, down = torch.randn(6, 2).bfloat16(), torch.randn(2, 4).bfloat16()
    p = LowRank("weight", up=up, down=down, scale=0.5)
    w = torch.randn(6, 4)
    close(p.apply(w.clone(), -1.5), w.double() - 1.5 * ref_lowrank(up, down, 0.5))


@pytest.mark.parametrize("kernel", [(3,), (3, 2), (2, 3, 2)], ids=["conv1d", "conv2d", "conv3d"])
def test_locon_conv_delta(kernel):
    out_c, in_c, r = 5, 4, 3
    up = torch.randn(out_c, r, *([1] * len(kernel)))
    down = torch.randn(r, in_c, *kernel)
    shape = (out_c, in_c, *kernel)
    p = LowRank("weight", up=up, down=down, scale=0.25)
    expected = ref_lowrank(up, down, 0.25)
    assert expected.shape == shape
    close(p.delta(shape), expected)
    w = torch.randn(shape)
    close(p.apply(w.clone(), 2.0), w.double() + 2.0 * expected)
    assert p.in_numel == in_c * torch.Size(kernel).numel()


@pytest.mark.parametrize("kernel", [(3,), (3, 3), (2, 3, 2)], ids=["conv1d", "conv2d", "conv3d"])
def test_tucker_mid_delta(kernel):
    out_c, in_c, r = 6, 5, 3
    ones = [1] * len(kernel)
    up = torch.randn(out_c, r, *ones)
    down = torch.randn(r, in_c, *ones)
    mid = torch.randn(r, r, *kernel)
    shape = (out_c, in_c, *kernel)
    p = LowRank("weight", up=up, down=down, mid=mid, scale=0.75)
    # Independent loop form of the Tucker product for one spatial position.
    expected = ref_lowrank(up, down, 0.75, mid=mid)
    pos = tuple(k - 1 for k in kernel)
    manual = torch.zeros(out_c, in_c, dtype=torch.float64)
    for i in range(r):
        for j in range(r):
            manual += mid[(i, j, *pos)].double() * torch.outer(
                up[(slice(None), i, *[0] * len(kernel))].double(),
                down[(j, slice(None), *[0] * len(kernel))].double())
    torch.testing.assert_close(expected[(slice(None), slice(None), *pos)], 0.75 * manual)

    close(p.delta(shape), expected)
    w = torch.randn(shape)
    close(p.apply(w.clone(), 0.3), w.double() + 0.3 * expected)
    assert p.in_numel == in_c * torch.Size(kernel).numel()
    p.check(shape, "conv.weight")


def test_transposed_embedding_delta():
    vocab, dim, r = 10, 6, 2
    down, up = torch.randn(r, vocab), torch.randn(dim, r)  # PEFT lora_embedding_A / _B
    p = LowRank("weight", up=up, down=down, scale=1.5, transposed=True)
    expected = 1.5 * (up.double() @ down.double()).T
    close(p.delta((vocab, dim)), expected)
    w = torch.randn(vocab, dim)
    close(p.apply(w.clone(), 0.5), w.double() + 0.5 * expected)
    assert p.out_rows == vocab
    p.check((vocab, dim), "emb.weight")
    with pytest.raises(ShapeMismatchError, match="emb.weight"):
        p.check((dim, vocab), "emb.weight")


def test_fan_in_fan_out_delta():
    # GPT-2 Conv1D stores (in, out); PEFT's A is (r, in), B is (out, r).
    in_f, out_f, r = 4, 9, 3
    down, up = torch.randn(r, in_f), torch.randn(out_f, r)
    p = LowRank("weight", up=up, down=down, scale=2.0, transposed=True)
    close(p.delta((in_f, out_f)), 2.0 * (up.double() @ down.double()).T)


# -- kohya Flux split qkv ---------------------------------------------------------------------


def block_diag_up(heights: list[int], r: int) -> torch.Tensor:
    blocks = [torch.randn(h, r) for h in heights]
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("heights", [[4, 4, 4], [3, 3, 3, 5], [6, 2]])
def test_split_qkv_block_diagonal_scale_times_blocks(heights):
    r, in_f = 2, 5
    n = len(heights)
    up = block_diag_up(heights, r)
    down = torch.randn(n * r, in_f)
    alpha = 3.0
    scale = alpha / (n * r)  # what a reader computes from down.shape[0]
    p = LowRank("weight", up=up, down=down, scale=scale, alpha_value=alpha, split_qkv=True)
    assert p.effective_scale == pytest.approx(n * scale)
    expected = (alpha / r) * (up.double() @ down.double())
    shape = (sum(heights), in_f)
    close(p.delta(shape), expected)
    w = torch.randn(shape)
    close(p.apply(w.clone(), 0.9), w.double() + 0.9 * expected)
    # Each block's delta is that split's own alpha / r LoRA.
    start = 0
    for j, h in enumerate(heights):
        own = (alpha / r) * up[start:start + h, j * r:(j + 1) * r].double() \
            @ down[j * r:(j + 1) * r].double()
        close(p.delta(shape)[start:start + h], own)
        start += h
    assert split_blocks(up, n * r) == [
        (sum(heights[:j]), sum(heights[:j + 1])) for j in range(n)]


def test_split_qkv_dense_up_keeps_scale():
    up, down = torch.randn(12, 6), torch.randn(6, 5)
    p = LowRank("weight", up=up, down=down, scale=0.5, split_qkv=True)
    assert p.effective_scale == 0.5
    close(p.delta((12, 5)), ref_lowrank(up, down, 0.5))
    assert split_blocks(up, 6) == [(0, 12)]


def test_split_qkv_almost_block_diagonal_keeps_scale():
    up = block_diag_up([4, 4, 4], 2)
    up[0, 5] = 0.25  # one entry outside the diagonal blocks
    down = torch.randn(6, 3)
    p = LowRank("weight", up=up, down=down, scale=0.5, split_qkv=True)
    assert p.effective_scale == 0.5
    close(p.delta((12, 3)), ref_lowrank(up, down, 0.5))


def test_block_diagonal_without_flag_keeps_scale():
    up = block_diag_up([4, 4, 4], 2)
    down = torch.randn(6, 3)
    p = LowRank("weight", up=up, down=down, scale=0.5)
    assert p.effective_scale == 0.5
    close(p.delta((12, 3)), ref_lowrank(up, down, 0.5))


# -- check ------------------------------------------------------------------------------------


def test_check_shapes():
    p = LowRank("weight", up=torch.randn(8, 2), down=torch.randn(2, 4))
    p.check((8, 4), "lin.weight")
    p.check(torch.Size([8, 4]), "lin.weight")
    with pytest.raises(ShapeMismatchError, match="lin.weight"):
        p.check((8, 5), "lin.weight")
    with pytest.raises(ShapeMismatchError, match="lora patch"):
        p.check((4, 8), "lin.weight")  # same numel, wrong output rows
    conv = LowRank("weight", up=torch.randn(8, 2, 1, 1), down=torch.randn(2, 4, 3, 3))
    conv.check((8, 4, 3, 3), "c.weight")
    with pytest.raises(ShapeMismatchError, match="c.weight"):
        conv.check((8, 4, 1, 1), "c.weight")
    tucker = LowRank("weight", up=torch.randn(8, 2, 1, 1), down=torch.randn(2, 4, 1, 1),
                     mid=torch.randn(2, 2, 3, 3))
    with pytest.raises(ShapeMismatchError):
        tucker.check((8, 4, 1, 1), "t.weight")


# -- residual ---------------------------------------------------------------------------------


def test_residual_linear():
    layer = nn.Linear(5, 7)
    up, down = torch.randn(7, 3), torch.randn(3, 5)
    p = LowRank("weight", up=up, down=down, scale=0.4)
    x = torch.randn(2, 4, 5)
    expected = F.linear(x.double(), ref_lowrank(up, down, 0.4))
    close(p.residual(x, layer), expected, rtol=1e-5, atol=1e-4)


def test_residual_split_qkv_uses_effective_scale():
    layer = nn.Linear(4, 9)
    up = block_diag_up([3, 3, 3], 2)
    down = torch.randn(6, 4)
    p = LowRank("weight", up=up, down=down, scale=1 / 6, split_qkv=True)
    x = torch.randn(3, 4)
    expected = F.linear(x.double(), 0.5 * (up.double() @ down.double()))
    close(p.residual(x, layer), expected, rtol=1e-5, atol=1e-4)


CONVS = [
    (nn.Conv1d, (3,), dict(stride=2, padding=1), (2, 4, 11)),
    (nn.Conv2d, (3, 3), dict(stride=(2, 1), padding=(1, 2)), (2, 4, 7, 6)),
    (nn.Conv2d, (3, 3), dict(padding=2, dilation=2), (1, 4, 8, 8)),
    (nn.Conv3d, (2, 3, 3), dict(stride=1, padding=(0, 1, 1)), (1, 4, 4, 5, 5)),
]


@pytest.mark.parametrize("cls,kernel,kw,xshape", CONVS, ids=["1d", "2d", "2d-dil", "3d"])
def test_residual_conv_locon(cls, kernel, kw, xshape):
    layer = cls(4, 6, kernel, **kw)
    spatial = len(kernel)
    up = torch.randn(6, 3, *([1] * spatial))
    down = torch.randn(3, 4, *kernel)
    p = LowRank("weight", up=up, down=down, scale=0.5)
    x = torch.randn(xshape)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    expected = conv(x.double(), ref_lowrank(up, down, 0.5), None, layer.stride, layer.padding,
                    layer.dilation)
    close(p.residual(x, layer), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cls,kernel,kw,xshape", CONVS, ids=["1d", "2d", "2d-dil", "3d"])
def test_residual_conv_tucker(cls, kernel, kw, xshape):
    layer = cls(4, 6, kernel, **kw)
    spatial = len(kernel)
    up = torch.randn(6, 2, *([1] * spatial))
    down = torch.randn(2, 4, *([1] * spatial))
    mid = torch.randn(2, 2, *kernel)
    p = LowRank("weight", up=up, down=down, mid=mid, scale=1.25)
    x = torch.randn(xshape)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    expected = conv(x.double(), ref_lowrank(up, down, 1.25, mid=mid), None, layer.stride,
                    layer.padding, layer.dilation)
    close(p.residual(x, layer), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_residual_embedding(padding_idx):
    vocab, dim, r = 12, 5, 3
    layer = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    down, up = torch.randn(r, vocab), torch.randn(dim, r)
    p = LowRank("weight", up=up, down=down, scale=0.6, transposed=True)
    x = torch.tensor([[0, 3, 11], [5, 5, 1]])
    delta = 0.6 * (up.double() @ down.double()).T  # (vocab, dim)
    close(p.residual(x, layer), F.embedding(x, delta), rtol=1e-5, atol=1e-5)


# -- TensorRef, load, nbytes, shapes ----------------------------------------------------------


def test_refs_check_without_reading_then_load():
    up, down, mid = torch.randn(6, 2, 1, 1), torch.randn(2, 3, 1, 1), torch.randn(2, 2, 3, 3)
    refs = [Ref(up), Ref(down), Ref(mid)]
    assert all(isinstance(r, TensorRef) for r in refs)
    p = LowRank("weight", up=refs[0], down=refs[1], mid=refs[2], scale=0.5)
    p.check((6, 3, 3, 3), "c.weight")
    assert p.shapes() == {"up": (6, 2, 1, 1), "down": (2, 3, 1, 1), "mid": (2, 2, 3, 3)}
    assert p.nbytes == (12 + 6 + 36) * 4
    assert p.dtype == torch.float32
    assert [r.loads for r in refs] == [0, 0, 0]

    loaded = p.load()
    assert [r.loads for r in refs] == [1, 1, 1]
    assert loaded is not p and isinstance(loaded, LowRank)
    assert all(isinstance(t, torch.Tensor) for _, t in loaded.tensors())
    assert loaded.up is up and loaded.down is down and loaded.mid is mid
    assert loaded.scale == 0.5 and loaded.param == "weight"
    assert isinstance(p.up, Ref)  # the original keeps its placeholders
    close(loaded.delta((6, 3, 3, 3)), ref_lowrank(up, down, 0.5, mid=mid))


def test_load_to_device_and_dtype_kept():
    up, down = torch.randn(4, 2, dtype=torch.float16), torch.randn(2, 3, dtype=torch.float16)
    p = LowRank("weight", up=Ref(up), down=Ref(down)).load("cpu")
    assert p.up.dtype == torch.float16 and p.up.device.type == "cpu"
    torch.testing.assert_close(p.down, down, rtol=0, atol=0)


def test_nbytes_and_shapes_mixed_dtypes():
    p = LowRank("weight", up=torch.randn(10, 4).bfloat16(), down=torch.randn(4, 7).bfloat16())
    assert p.nbytes == (40 + 28) * 2
    assert p.shapes() == {"up": (10, 4), "down": (4, 7)}
    assert [name for name, _ in p.tensors()] == ["up", "down"]
    assert p.dtype == torch.bfloat16
    assert LowRank.tensor_fields == ("up", "down", "mid")
    assert Patch.additive and LowRank.additive


def test_patch_kinds_registry():
    expected = {"lora": LowRank, "loha": LoHa, "lokr": LoKr, "diff": Diff, "set": Set,
                "ia3": IA3, "dora": DoRA}
    for kind, cls in expected.items():
        assert PATCH_KINDS[kind].patch is cls and PATCH_KINDS[kind].name == kind
        assert cls.kind == kind
    assert not IA3.additive and not DoRA.additive and not Set.additive
    assert Diff.additive and LoHa.additive and LoKr.additive
    with pytest.raises(AssertionError, match="registered twice"):
        register_patch("lora")(type("Again", (Patch,), {}))


def test_register_patch_adds_kind():
    try:
        @register_patch("test-only-kind")
        class Custom(Patch):
            pass

        assert PATCH_KINDS["test-only-kind"].patch is Custom
        assert Custom.kind == "test-only-kind"
    finally:
        PATCH_KINDS.pop("test-only-kind", None)
