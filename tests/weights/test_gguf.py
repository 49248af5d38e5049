"""GGUF block dequantization against the gguf package (when installed) and against per-element
references written here from ggml's C loops; GGUFWeight is not mergeable.
"""

from __future__ import annotations

import struct

import pytest
import torch

from shuttle.errors import ShuttleError, UnmergeableWeightError
from shuttle.weights import GGUF_TYPES, GGUFWeight, dequantize_blocks

TYPES = list(GGUF_TYPES)


def random_blocks(name: str, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` blocks of random bytes whose float16 fields are finite, moderate numbers."""
    g = torch.Generator().manual_seed(seed)
    _, size, _, _ = GGUF_TYPES[name]
    raw = torch.randint(0, 256, (n, size), generator=g, dtype=torch.uint8)
    offsets = {"Q8_0": [0], "Q4_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[name]
    for o in offsets:
        halves = (torch.randn(n, 1, generator=g) * 0.01).half()
        raw[:, o:o + 2] = halves.view(torch.uint8)
    return raw


def _half(b: bytes) -> float:
    return struct.unpack("<e", b)[0]


def reference_block(name: str, b: bytes) -> list[float]:
    """One block, element by element, following ggml's dequantize_row_* loops."""
    if name == "Q8_0":
        d = _half(b[0:2])
        return [d * struct.unpack("b", b[2 + j:3 + j])[0] for j in range(32)]
    if name == "Q4_0":
        d = _half(b[0:2])
        qs = b[2:18]
        return [((qs[j] & 0xF) - 8) * d for j in range(16)] + \
               [((qs[j] >> 4) - 8) * d for j in range(16)]
    if name == "Q4_K":
        d, dmin, sc, qs = _half(b[0:2]), _half(b[2:4]), b[4:16], b[16:144]

        def scale_min(j: int) -> tuple[int, int]:
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return ((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
                    (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4))

        y, q, i = [], 0, 0
        for _ in range(4):
            s1, m1 = scale_min(i)
            s2, m2 = scale_min(i + 1)
            y += [d * s1 * (qs[q + l] & 0xF) - dmin * m1 for l in range(32)]
            y += [d * s2 * (qs[q + l] >> 4) - dmin * m2 for l in range(32)]
            q, i = q + 32, i + 2
        return y
    assert name == "Q6_K"
    ql, qh = b[0:128], b[128:192]
    sc = struct.unpack("16b", b[192:208])
    d = _half(b[208:210])
    y = [0.0] * 256
    for half in range(2):
        o, lo, hi, s = 128 * half, 64 * half, 32 * half, 8 * half
        for l in range(32):
            i = l // 16
            q1 = ((ql[lo + l] & 0xF) | (((qh[hi + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[lo + l + 32] & 0xF) | (((qh[hi + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[lo + l] >> 4) | (((qh[hi + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[lo + l + 32] >> 4) | (((qh[hi + l] >> 6) & 3) << 4)) - 32
            y[o + l] = d * sc[s + i] * q1
            y[o + l + 32] = d * sc[s + i + 2] * q2
            y[o + l + 64] = d * sc[s + i + 4] * q3
            y[o + l + 96] = d * sc[s + i + 6] * q4
    return y


@pytest.mark.parametrize("name", TYPES)
def test_against_per_element_reference(name):
    raw = random_blocks(name, 6)
    want = [v for row in raw for v in reference_block(name, bytes(row.tolist()))]
    got = dequantize_blocks(raw, name)
    # the reference computes in float64; shuttle in float32 like ggml
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", TYPES)
def test_against_gguf_package(name):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    raw = random_blocks(name, 64, seed=1)
    qtype = gguf.GGMLQuantizationType[name]
    want = dequantize(raw.numpy().reshape(8, -1), qtype).reshape(-1)
    got = dequantize_blocks(raw, qtype)  # a ggml type id works as well as a name
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_gguf_quantized_weight_round_trips(name):
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from gguf.quants import dequantize, quantize

    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[name]
    raw = torch.from_numpy(quantize(x, qtype))
    w = GGUFWeight(raw, name, (8, 64))
    assert torch.equal(w.dequantize(), torch.from_numpy(dequantize(raw.numpy(), qtype)))
    torch.testing.assert_close(w.dequantize(), torch.from_numpy(x), atol=0.3, rtol=0.2)


def test_weight_representation_and_unmergeable():
    raw = random_blocks("Q4_K", 4)  # 4 super-blocks = 1024 values
    w = GGUFWeight(raw, "q4_k", (8, 128))
    assert w.qtype == "Q4_K" and w.logical_shape == (8, 128) and not w.mergeable
    assert w.nbytes == 4 * 144
    assert torch.equal(w.dequantize().reshape(-1), dequantize_blocks(raw, "Q4_K"))
    for moved in (w.to("cpu"), w.pin()):
        assert isinstance(moved, GGUFWeight) and moved.qtype == "Q4_K"
        assert moved.raw.dtype == torch.uint8 and torch.equal(moved.raw, raw)
    with pytest.raises(UnmergeableWeightError, match='mode="dynamic"'):
        w.encode(w.dequantize())


def test_bad_inputs_raise():
    with pytest.raises(ShuttleError, match="not supported"):
        GGUFWeight(torch.zeros(34, dtype=torch.uint8), "Q5_K", (32,))
    with pytest.raises(ShuttleError, match="does not hold"):
        GGUFWeight(torch.zeros(34, dtype=torch.uint8), "Q8_0", (64,))
    with pytest.raises(ShuttleError, match="whole"):
        dequantize_blocks(torch.zeros(35, dtype=torch.uint8), "Q8_0")
