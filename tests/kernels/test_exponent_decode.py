"""The Triton decoder of lossless-coded weights against its PyTorch reference."""

from __future__ import annotations

import functools

import pytest
import torch

from shuttle.kernels.exponent_decode import (
    DECODE_KERNELS,
    FIRST_BITS,
    GROUP,
    LANES,
    MAX_LEN,
    decode_exponents,
    decode_exponents_reference,
    group_checks,
    stored_table,
    table_index,
)
from shuttle.weights.lossless import LosslessTensor

KERNELS = sorted(DECODE_KERNELS)


def _decode(fn, rep: LosslessTensor) -> tuple[torch.Tensor, int]:
    p = rep.parts()
    out = torch.empty(rep.numel, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int32)
    fn(p.words, p.offsets, p.lut, p.raw, p.checks, out, errors, rep.dtype == torch.bfloat16)
    return out, int(errors)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_decodes_what_the_reference_decodes(dtype, kernel):
    # two groups, the second short; special values among Gaussian weights
    x = (torch.randn(GROUP + 301) * 0.02).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")], dtype=dtype)
    x[GROUP + 7] = torch.finfo(dtype).tiny / 4  # a subnormal
    rep = LosslessTensor.encode_tensor(x)
    assert rep is not None
    # the rare symbols (the special values) get codes longer than the first-level table's
    assert int((rep.parts().lut & 15).max()) > FIRST_BITS
    want = x.view(torch.int16)
    got, errors = _decode(functools.partial(decode_exponents, kernel=kernel), rep)
    ref, ref_errors = _decode(decode_exponents_reference, rep)
    assert errors == ref_errors == 0
    assert torch.equal(got, want) and torch.equal(ref, want)


def test_the_stored_table_puts_every_short_code_in_its_first_entries():
    from shuttle.weights.lossless import _canonical, code_lengths

    counts = [0] * 256
    for s, c in zip([120, 121, 119, 122, 118, 123, 0, 255, 117, 116],
                    [900, 500, 400, 120, 60, 30, 4, 1, 1, 1], strict=True):
        counts[s] = c
    _, lut = _canonical(code_lengths(counts))
    stored = stored_table(lut)
    peeks = torch.arange(1 << MAX_LEN)
    assert torch.equal(stored[table_index(peeks)], lut)
    short = (lut & 15) <= FIRST_BITS
    assert bool(short.any()) and bool((~short).any())
    first = stored[peeks >> (MAX_LEN - FIRST_BITS)]
    assert torch.equal(first[short], lut[short])


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_counts_a_damaged_group(kernel):
    x = (torch.randn(2000) * 0.1).to(torch.bfloat16)
    rep = LosslessTensor.encode_tensor(x, always=True)
    rep.parts().words[0] ^= 1 << 30  # the second bit of lane 0's first code
    _, errors = _decode(functools.partial(decode_exponents, kernel=kernel), rep)
    _, ref_errors = _decode(decode_exponents_reference, rep)
    assert errors == ref_errors == 1


@pytest.mark.parametrize("decode", [decode_exponents_reference,
                                    *(functools.partial(decode_exponents, kernel=k)
                                      for k in KERNELS)], ids=["reference", *KERNELS])
def test_damaged_offsets_fail_the_checks_without_reading_past_the_words(decode):
    # two groups, the second short; offsets pointing before the words and at the padding word
    # (group 0), far past them (group 1)
    x = (torch.randn(GROUP + 500) * 0.02).to(torch.bfloat16)
    rep = LosslessTensor.encode_tensor(x, always=True)
    offsets = rep.parts().offsets
    offsets[3] = -7
    offsets[9] = rep.parts().words.numel() - 1
    offsets[LANES] = 2**30
    _, errors = _decode(decode, rep)
    assert errors == 2


def test_a_group_check_catches_any_single_changed_value():
    g = torch.Generator().manual_seed(1)
    v = torch.randint(0, 2**16, (GROUP,), generator=g, dtype=torch.int32)
    base = group_checks(v)
    for k in torch.randint(0, v.numel(), (64,), generator=g).tolist():
        w = v.clone()
        w[k] = (w[k] + int(torch.randint(1, 2**16, (1,), generator=g))) % 2**16
        assert not torch.equal(group_checks(w), base), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_reference_decodes_slice_by_slice(dtype, monkeypatch):
    """The reference decodes a few groups at a time (bounded temporaries): the values, and the
    count of damaged groups, are those of one pass over every group.
    """
    from shuttle.kernels import exponent_decode

    x = (torch.randn(4 * GROUP + 301) * 0.02).to(dtype)
    rep = LosslessTensor.encode_tensor(x, always=True)
    whole, whole_errors = _decode(decode_exponents_reference, rep)
    monkeypatch.setattr(exponent_decode, "REFERENCE_GROUPS", 2)
    sliced, errors = _decode(decode_exponents_reference, rep)
    assert whole_errors == errors == 0
    assert torch.equal(sliced, whole) and torch.equal(sliced, x.view(torch.int16))
    p = rep.parts()
    p.words[int(p.offsets[3 * LANES])] ^= 1 << 30  # group 3's first lane: in the second slice
    _, errors = _decode(decode_exponents_reference, rep)
    assert errors == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_decode_exactly_and_count_damaged_offsets(dtype, kernel):
    x = (torch.randn(3 * GROUP * 40 + 123) * 0.02).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")], dtype=dtype)
    rep = LosslessTensor.encode_tensor(x)
    blob = rep.blob.cuda()
    p = rep.parts(blob)
    out = torch.empty(rep.numel, dtype=torch.int16, device="cuda")
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    decode_exponents(p.words, p.offsets, p.lut, p.raw, p.checks, out, errors,
                     dtype == torch.bfloat16, kernel=kernel)
    assert int(errors) == 0 and torch.equal(out.cpu(), x.view(torch.int16))
    p.offsets[3] = -7
    p.offsets[LANES + 5] = 2**30  # far past the words: masked, not read
    decode_exponents(p.words, p.offsets, p.lut, p.raw, p.checks, out, errors,
                     dtype == torch.bfloat16, kernel=kernel)
    torch.cuda.synchronize()
    assert int(errors) == 2
