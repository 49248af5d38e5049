"""LosslessTensor: every bfloat16/float16 bit pattern round-trips; damage is always refused.

The decodes here run the PyTorch reference (the Triton kernel is checked against it in
tests/kernels/test_exponent_decode.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shuttle.errors import CorruptCodeError, ShuttleError
from shuttle.kernels import exponent_decode
from shuttle.kernels.exponent_decode import MAX_LEN
from shuttle.weights import REPRESENTATIONS
from shuttle.weights.lossless import LosslessTensor, code_lengths

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setattr(exponent_decode, "interpreting", lambda: False)  # CPU: the reference


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int16)


def _gaussian(n: int, dtype: torch.dtype, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


def test_registered_as_a_representation():
    assert REPRESENTATIONS["lossless"] is LosslessTensor


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_weights_code_smaller_and_round_trip(dtype):
    x = _gaussian(98315, dtype)
    rep = LosslessTensor.encode_tensor(x)
    assert rep is not None and rep.nbytes < 2 * x.numel()
    if dtype == torch.bfloat16:
        assert rep.ratio < 0.72  # about 2.7 bits of exponent + 8 raw bits a value
    assert rep.logical_shape == x.shape and rep.compute_dtype == dtype
    assert torch.equal(_bits(rep.decode()), _bits(x))


@st.composite
def _patterns(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(2**14, 3 * 2**15))
    x = _gaussian(n, dtype, seed=draw(st.integers(0, 2**16)),
                  scale=draw(st.sampled_from([1e-3, 0.02, 1.0, 300.0])))
    bits = x.view(torch.int16)
    # special patterns spliced in anywhere: signed zeros, subnormals, infinities, NaN payloads,
    # or any 16 bits at all
    specials = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(-2**15, 2**15 - 1)),
                             max_size=64))
    for at, pattern in specials:
        bits[at] = pattern
    return x


@given(_patterns())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_bit_pattern_round_trips(x):
    rep = LosslessTensor.encode_tensor(x, always=True)
    assert torch.equal(_bits(rep.decode()), _bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (7, 1, 9), (2**15 + 1,)])
def test_any_shape_round_trips(dtype, shape):
    x = _gaussian(max(1, int(torch.Size(shape).numel())), dtype).view(shape)
    rep = LosslessTensor.encode_tensor(x, always=True)
    y = rep.decode()
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(_bits(y), _bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_that_do_not_compress_stay_raw(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2**15, 2**15, (2**16,), generator=g, dtype=torch.int16).view(dtype)
    assert LosslessTensor.encode_tensor(x) is None
    forced = LosslessTensor.encode_tensor(x, always=True)
    assert torch.equal(_bits(forced.decode()), _bits(x))


def test_a_small_tensor_is_not_worth_a_code():
    assert LosslessTensor.encode_tensor(_gaussian(100, torch.bfloat16)) is None
    assert LosslessTensor.encode_tensor(torch.empty(0, dtype=torch.bfloat16)) is None


def test_other_dtypes_are_refused():
    with pytest.raises(ShuttleError, match="bfloat16 or float16"):
        LosslessTensor.encode_tensor(torch.zeros(10))


@pytest.mark.parametrize("part", ["lut", "checks", "offsets", "raw", "words"])
def test_a_flipped_bit_in_any_part_is_refused(part):
    x = _gaussian(40000, torch.bfloat16)
    rep = LosslessTensor.encode_tensor(x)
    data = getattr(rep.parts(), part).view(torch.uint8)
    at = {"lut": int(rep.parts().lut.view(torch.uint8).nonzero()[0]), "words": 4 * 1000 + 1,
          "offsets": 4 * 7, "raw": 12345, "checks": 0}[part]
    data[at] ^= 4
    with pytest.raises(CorruptCodeError, match="damaged"):
        rep.decode()


def test_a_truncated_blob_is_refused():
    rep = LosslessTensor.encode_tensor(_gaussian(40000, torch.bfloat16))
    cut = LosslessTensor(rep.blob[:-16], rep.shape, rep.dtype, rep.words)
    with pytest.raises(CorruptCodeError, match="truncated"):
        cut.decode()


@given(st.lists(st.integers(0, 2**40), min_size=256, max_size=256))
@settings(max_examples=60, deadline=None)
def test_code_lengths_are_a_prefix_code_within_the_limit(counts):
    lengths = code_lengths(counts)
    used = [n for n, c in zip(lengths, counts, strict=True) if c]
    assert all(1 <= n <= MAX_LEN for n in used)
    assert all(n == 0 for n, c in zip(lengths, counts, strict=True) if not c)
    assert sum(2.0 ** -n for n in used) <= 1.0  # Kraft: the code is decodable


def test_code_lengths_limit_a_deep_tree():
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    lengths = code_lengths(fib + [0] * (256 - len(fib)))
    assert max(lengths) == MAX_LEN  # the plain Huffman tree is 39 deep
    assert sum(2.0 ** -n for n in lengths if n) == 1.0


def test_the_code_is_the_same_bytes_every_time():
    """Every byte of the blob is written (the gaps between its aligned parts too): one tensor
    codes to one blob, and a file of it to one set of bytes."""
    w = _gaussian(70_001, torch.bfloat16)
    torch.empty(1 << 22, dtype=torch.uint8).fill_(0xAB)  # leave garbage for a reused block
    assert torch.equal(LosslessTensor.encode_tensor(w).blob, LosslessTensor.encode_tensor(w).blob)


def test_coding_slice_by_slice_gives_the_bytes_of_one_pass(monkeypatch):
    """The encoder reads a tensor in slices of whole chunks (bounded temporaries); the code
    does not depend on where the slices fall."""
    from shuttle.kernels.exponent_decode import GROUP, decode_exponents_reference
    from shuttle.weights import lossless

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        w = (torch.randn(5 * GROUP + 123, generator=g) * 0.05).to(dtype)
        whole = LosslessTensor.encode_tensor(w, always=True)
        monkeypatch.setattr(lossless, "_CHUNK_GROUPS", 1)
        monkeypatch.setattr(lossless, "_SLICE", 2 * GROUP)
        sliced = LosslessTensor.encode_tensor(w, always=True)
        monkeypatch.undo()
        assert sliced.words == whole.words
        assert torch.equal(sliced.blob, whole.blob)
        # (the PyTorch reference decodes: the interpreted kernel would take seconds a group)
        p = sliced.parts()
        out, errors = torch.empty(w.numel(), dtype=torch.int16), torch.zeros(1, dtype=torch.int32)
        decode_exponents_reference(p.words, p.offsets, p.lut, p.raw, p.checks, out, errors,
                                   dtype == torch.bfloat16)
        assert int(errors) == 0 and torch.equal(out, w.view(torch.int16))


def test_a_device_out_of_memory_codes_on_the_cpu(monkeypatch):
    """A small card cannot hold coding's temporaries: the host codes the tensor instead."""
    w = (torch.randn(256, 512) * 0.02).bfloat16()
    real = LosslessTensor.encode_tensor.__func__
    tried = []

    def encode(cls, tensor, **kw):
        tried.append(tensor.device.type)
        if tensor.device.type != "cpu":
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(cls, tensor, **kw)
    monkeypatch.setattr(LosslessTensor, "encode_tensor", classmethod(encode))
    rep = LosslessTensor.encode_host(w, device="meta")
    assert tried == ["meta", "cpu"]
    assert rep.blob.device.type == "cpu"
    assert torch.equal(rep.blob, real(LosslessTensor, w).blob)


def test_encode_re_codes_a_merged_weight():
    x = _gaussian(40000, torch.bfloat16)
    rep = LosslessTensor.encode_tensor(x)
    merged = rep.dequantize() + 1e-3
    again = rep.encode(merged)
    assert isinstance(again, LosslessTensor)
    assert torch.equal(_bits(again.decode()), _bits(merged.to(torch.bfloat16)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_codes_and_decodes_what_the_cpu_does(dtype, monkeypatch):
    monkeypatch.undo()  # the Triton kernel on CUDA
    x = _gaussian(3072 * 1024 + 77, dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")], dtype=dtype)
    cpu = LosslessTensor.encode_tensor(x)
    gpu = LosslessTensor.encode_tensor(x.cuda())
    assert gpu.blob.is_cuda and torch.equal(gpu.blob.cpu(), cpu.blob)  # one code everywhere
    assert torch.equal(_bits(gpu.decode().cpu()), _bits(x))
    damaged = LosslessTensor(gpu.blob.clone(), gpu.shape, gpu.dtype, gpu.words)
    damaged.parts().raw[5] ^= 1
    with pytest.raises(CorruptCodeError):
        damaged.decode()


def test_a_device_without_an_index_takes_a_tensor_on_any_device_of_its_type():
    """code_size moves a host tensor to "cuda" and asks again: "cuda" must then count as where
    the tensor is (torch.device("cuda") != torch.device("cuda", 0): compared as is, the
    question never ended, a RecursionError on every machine with a GPU)."""
    from shuttle.weights.lossless import _elsewhere

    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    assert not _elsewhere(cuda0, "cuda") and not _elsewhere(cuda1, "cuda")
    assert not _elsewhere(cuda0, "cuda:0") and _elsewhere(cuda0, "cuda:1")
    assert _elsewhere(cpu, "cuda") and _elsewhere(cuda0, "cpu") and not _elsewhere(cpu, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_sizes_a_host_tensor_as_it_codes_it(dtype, monkeypatch):
    """By default both size and code a host tensor on the GPU: the same words and bytes."""
    monkeypatch.undo()
    x = _gaussian(3 * 1024 * 1024 + 77, dtype)
    rep = LosslessTensor.encode_host(x)
    assert LosslessTensor.code_size(x) == (rep.words, rep.blob.numel())
    assert LosslessTensor.code_size(x, device="cpu") == (rep.words, rep.blob.numel())


@pytest.mark.parametrize("dtype", DTYPES)
def test_code_size_is_the_size_of_the_code(dtype):
    """The sizes a compressed file's header is written with, found without coding."""
    from shuttle.kernels.exponent_decode import GROUP

    for w in [_gaussian(3 * GROUP + 77, dtype), _gaussian(1, dtype),
              torch.randint(-2**15, 2**15, (5000,), dtype=torch.int16).view(dtype)]:
        rep = LosslessTensor.encode_tensor(w)
        size = LosslessTensor.code_size(w)
        assert size == (None if rep is None else (rep.words, rep.blob.numel()))
        forced = LosslessTensor.encode_tensor(w, always=True)
        assert LosslessTensor.code_size(w, always=True) == (forced.words, forced.blob.numel())
