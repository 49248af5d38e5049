"""The CuTe-DSL program of the fused LoRA linear's Hopper GEMM (its launcher and its device kernel,
``lora_gemm_sm90_device``), compiled on the CPU.

The DSL compiles the kernel for sm_90a without a GPU, so these tests check the program it emits:
the warpgroup MMA at the tile's shape, one producer warpgroup beside the consumers, eight TMA
descriptors, the shrink's handoff only in its form, the bias read only where asked. Its numerics are
checked on the H200 (tests/kernels/test_lora_linear_cute.py).
"""

from __future__ import annotations

import re

import pytest

from shuttle.kernels.cute_dsl import CUTE_TILES, PINGPONG_TILES
from shuttle.kernels.lora_gemm_sm90 import compile_lora_gemm
from shuttle.kernels.lora_linear_cute import cute_installed
from tests.kernels.test_lora_linear import BF16, FP16
from tests.kernels.test_lora_linear_cute import tile_id

needs_dsl = pytest.mark.skipif(not cute_installed(), reason="nvidia-cutlass-dsl not installed")


@pytest.fixture(scope="module")
def ptx_of(tmp_path_factory):
    """The PTX of a compile (the DSL writes it under a dump folder: a temporary one here)."""
    options = f"--keep-ptx --dump-dir {tmp_path_factory.mktemp('cute')}"

    def ptx(dtype, tile, bias, shrink=False, pdl=False) -> str:
        return str(compile_lora_gemm(dtype, tile, bias, 132, options, shrink,
                                     pdl).artifacts.PTX)
    return ptx


@needs_dsl
@pytest.mark.parametrize("shrink", [False, True], ids=["s-given", "shrink"])
@pytest.mark.parametrize("tile", CUTE_TILES + PINGPONG_TILES, ids=tile_id)
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
    # a row tile reads one S tile, or two where S tiles (tile.n tokens) straddle row tiles
    spans = 0 if not shrink else 1 if tile.n % tile.m == 0 else 2
    assert len(re.findall(r"ld\.acquire\.gpu\.global", ptx)) == spans


@needs_dsl
@pytest.mark.parametrize("shrink", [False, True], ids=["s-given", "shrink"])
def test_pingpong_warpgroups_take_turns_and_end_their_epilogues_alone(shrink, ptx_of):
    """Ping-pong: each warpgroup waits for its turn at the main loop and at the epilogue
    (256-thread named barriers: its own threads and the other's arrival) and hands the turn on
    (bar.arrive); its epilogue's sub-tile barriers hold its 128 threads alone. The cooperative
    tile has one 256-thread epilogue barrier and no turns."""
    def barriers(ptx):
        return (len(re.findall(r"bar\.sync\s+%r\d+, 256", ptx)),
                len(re.findall(r"bar\.arrive\s+(?:%r\d+|\d+), 256", ptx)),
                bool(re.search(r"bar\.sync\s+%r\d+, 128", ptx)),
                bool(re.search(r"bar\.sync\s+1, 256", ptx)))
    pong = ptx_of(BF16, PINGPONG_TILES[0], True, shrink)
    # two turns waited (main loop, epilogue); two handed on, and the second warpgroup's start
    assert barriers(pong) == (2, 4, True, False)
    assert barriers(ptx_of(BF16, CUTE_TILES[1], True, shrink)) == (0, 0, False, True)


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


@needs_dsl
@pytest.mark.parametrize("tile", [CUTE_TILES[0], PINGPONG_TILES[0]], ids=tile_id)
def test_a_dependent_launch_waits_before_s_and_before_the_bias(tile, ptx_of):
    """With pdl the producer waits for the kernel before it (the one writing S) before its
    first S tile (in each copy the compiler unrolls its loop into), and the consumers once
    more before reading the bias; without it nothing waits."""
    def waits(ptx):
        return len(re.findall(r"griddepcontrol\.wait", ptx))
    producer = waits(ptx_of(BF16, tile, False, pdl=True))
    assert producer >= 1
    assert waits(ptx_of(BF16, tile, True, pdl=True)) == producer + 1
    assert waits(ptx_of(BF16, tile, True)) == 0
    with pytest.raises(ValueError, match="shrink form computes S itself"):
        compile_lora_gemm(BF16, tile, True, 132, "", shrink=True, pdl=True)
