"""``offload(..., device=...)`` refuses a device this machine lacks at once, with a typed error
naming it, instead of a bare AssertionError at the model's first call (issue 19, item 11)."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import DeviceUnavailableError
from shuttle.integrations.budgets import check_device

from .models import tiny_llama

shuttle_transformers = pytest.importorskip("shuttle.integrations.transformers")

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def test_known_devices_pass():
    assert check_device("cpu") == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda(device):
    with pytest.raises(DeviceUnavailableError, match="no cuda device.*or pass 'cpu'"):
        check_device(device)


def test_unknown_name():
    with pytest.raises(DeviceUnavailableError, match="'gpu0' is not a device name"):
        check_device("gpu0")


@no_cuda
def test_offload_checks_at_offload_time():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cls = type(model)
    with pytest.raises(DeviceUnavailableError, match="device='cuda'"):
        shuttle_transformers.offload(model, max_host_bytes=2**20, device="cuda")
    assert type(model) is cls  # nothing was installed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
