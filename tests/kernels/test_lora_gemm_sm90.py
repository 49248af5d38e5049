"""The CuTe-DSL program of the fused LoRA linear's Hopper GEMM, compiled on the CPU.

The DSL compiles the kernel for sm_90a without a GPU, so these tests check the program it emits:
the warpgroup MMA at the tile's shape, one producer warpgroup beside the consumers, five TMA
descriptors (x, W, S, B and the output), the bias read only where asked. Its numerics are
checked on the H200 (tests/kernels/test_lora_linear_cute.py).
"""

from __future__ import annotations

import re

import pytest

from shuttle.kernels.lora_gemm_sm90 import CUTE_TILES, compile_lora_gemm, dsl
from shuttle.kernels.lora_linear_cute import cute_installed
from tests.kernels.test_lora_linear import BF16, FP16

needs_dsl = pytest.mark.skipif(not cute_installed(), reason="nvidia-cutlass-dsl not installed")


@pytest.fixture(scope="module")
def ptx_of(tmp_path_factory):
    """The PTX of a compile (the DSL writes it under a dump folder: a temporary one here)."""
    options = f"--keep-ptx --dump-dir {tmp_path_factory.mktemp('cute')}"

    def ptx(dtype, tile, bias, shrink=False) -> str:
        return str(compile_lora_gemm(dtype, tile, bias, 132, options, shrink).artifacts.PTX)
    return ptx


@needs_dsl
@pytest.mark.parametrize("shrink", [False, True], ids=["s-given", "shrink"])
@pytest.mark.parametrize("tile", CUTE_TILES, ids=lambda t: f"{t.m}x{t.n}")
@pytest.mark.parametrize(("dtype", "ptx_type"), [(BF16, "bf16"), (FP16, "f16")])
def test_compiles_for_hopper_on_the_cpu(tile, dtype, ptx_type, shrink, ptx_of):
    ptx = ptx_of(dtype, tile, True, shrink)
    assert ".target sm_90a" in ptx
    # float32 accumulation of 16-bit operands at the tile's width, 64 rows per instruction
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.(\w+)\.(\w+)\.(\w+)", ptx))
    assert mmas == {(f"m64n{tile.n}k16", "f32", ptx_type, ptx_type)}
    # a producer warpgroup beside the consumer warpgroups, registers moved between them
    assert f".reqntid {128 * (1 + tile.consumers)}, 1, 1" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    # x, W, S, B, A and x as the N operand loaded, the output and S^T stored by TMA: eight
    # 128-byte descriptors (the shrink's three stand in for others where S is given)
    assert len(re.findall(r"\.param \.align 64 \.b8 \w+\[128\]", ptx)) == 8
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
    # With the shrink, an S tile leaves through the transposing stmatrix; its store warp waits
    # until its stores are complete (not only read) and releases the tile's flag, which the
    # readers' producer acquires (and the last reader resets) before loading S back.
    handoff = [r"stmatrix\.sync\.aligned\.m8n8\.x4\.trans", r"cp\.async\.bulk\.wait_group\s+0",
               r"atom\.global\.release\.add", r"ld\.acquire\.gpu\.global", r"st\.global\.b32"]
    assert [bool(re.search(h, ptx)) for h in handoff] == [shrink] * len(handoff)


def test_the_shrink_work_list_puts_each_s_tile_before_its_readers():
    """Each output tile once; each S tile once, ``ahead`` S tiles before the first output tile
    of its rows (or at the start), never after one: a CTA waiting on an S tile waits on a unit
    taken earlier."""
    from shuttle.kernels.lora_gemm_sm90 import _S_UNIT, _UNIT_FIELD, shrink_work_list

    for m_blocks, tiles_n, per_s, ahead in [(7, 3, 2, 2), (256, 6, 2, 11), (1, 1, 1, 1),
                                            (5, 2, 1, 9), (34, 15, 2, 5)]:
        codes = shrink_work_list(m_blocks, tiles_n, per_s, ahead)
        s_at = {c - _S_UNIT: i for i, c in enumerate(codes) if c >= _S_UNIT}
        tiles = [(i, divmod(c, _UNIT_FIELD)) for i, c in enumerate(codes) if c < _S_UNIT]
        s_blocks = -(-m_blocks // per_s)
        assert sorted(s_at) == list(range(s_blocks))
        assert sorted(mn for _, mn in tiles) == [(m, n) for m in range(m_blocks)
                                                 for n in range(tiles_n)]
        first_reader = {}
        for i, (m, _) in tiles:
            first_reader.setdefault(m // per_s, i)
        for j, at in s_at.items():
            assert at < first_reader[j]
            # ahead S tiles' readers come between it and its own first reader
            between = {m // per_s for i, (m, _) in tiles if at < i < first_reader[j]}
            assert len(between) <= ahead
        assert codes[:min(ahead, s_blocks)] == [_S_UNIT + j for j in range(min(ahead,
                                                                               s_blocks))]
    with pytest.raises(ValueError, match="fields"):
        shrink_work_list(_UNIT_FIELD, 1, 2, 1)


@needs_dsl
def test_the_bias_is_read_only_when_the_layer_has_one(ptx_of):
    tile = CUTE_TILES[0]
    with_bias, without = ptx_of(BF16, tile, True), ptx_of(BF16, tile, False)
    assert re.search(r"\bld\.global[.\w]*", with_bias)
    assert not re.search(r"\bld\.global[.\w]*", without)


@needs_dsl
def test_compiles_for_a_tvm_ffi_launch_on_the_cpu():
    """The launch path the hopper extra takes (apache-tvm-ffi installed) compiles on the CPU:
    its C function only exists where a GPU loads the program."""
    from shuttle.kernels.lora_linear_cute import TVM_FFI_OPTION, tvm_ffi_installed

    if not tvm_ffi_installed():
        pytest.skip("apache-tvm-ffi not installed")
    compiled = compile_lora_gemm(BF16, CUTE_TILES[0], True, 132, TVM_FFI_OPTION)
    assert hasattr(compiled, "__tvm_ffi_object__")


def test_a_missing_dsl_names_the_extra(monkeypatch):
    import sys

    from shuttle.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "cutlass", None)  # import cutlass -> ImportError
    with pytest.raises(MissingDependencyError, match=r"shuttle\[hopper\]"):
        dsl.__wrapped__()
