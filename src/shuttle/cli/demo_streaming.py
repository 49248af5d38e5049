"""The memory half of ``shuttle demo``: a model several times larger than its VRAM budget,
built on ``meta`` and captured straight from its safetensors file under a host ceiling, streams
block by block with an adapter merged as each block lands, and gives the resident model's
output bit for bit.

What it shows (one row): the output against the resident model with the same adapter merged
(``torch.equal``), the peak device memory of the streamed calls against ``vram_budget``, the
host bytes shuttle holds (arenas, staging buffers, the adapter) against ``max_host_bytes``,
and the time of a call against its bound: the larger of the bytes a call moves to the device
over the pinned host-to-device bandwidth and the bytes it reads from disk over the disk's
read bandwidth as the disk tier reads (O_DIRECT, several reads in flight), both measured here.
On the CPU the same path runs through the CPU copy mode (slots and hooks as on CUDA; no device
memory to report).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file, save_model

import shuttle
from shuttle.cache import ModelCache
from shuttle.cli.table import format_bytes
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.integrations.handle import OffloadHandle
from shuttle.offload import CPU_COPY_ENV, ModelOffloader
from shuttle.offload.disk_reader import read_bandwidth

__all__ = ["run_streaming"]

# (dim, mlp, depth, latent side) of the model, and its budgets as fractions of its bytes.
_SIZES = {"cuda": (1024, 4096, 24, 64), "cpu": (128, 512, 8, 16)}
_VRAM_SHARE = 0.2  # the budget: a fifth of the model
_HOST_SHARE = 0.4  # the host ceiling: less than half of it


def run_streaming(device: str, model_cls: type[torch.nn.Module], g: torch.Generator
                  ) -> tuple[dict[str, object], bool]:
    """Stream a model of ``model_cls`` (``(channels, dim, mlp, depth)`` constructor, blocks
    under ``.blocks``) under budgets a fraction of its size; returns (the result row, ok).
    """
    kind = "cuda" if device.startswith("cuda") else "cpu"
    dim, mlp, depth, side = _SIZES[kind]
    dtype = torch.bfloat16
    ref = model_cls(4, dim, mlp, depth).to(dtype)
    weights = sum(t.nbytes for t in ref.state_dict().values())
    vram_budget, host_budget = int(_VRAM_SHARE * weights), int(_HOST_SHARE * weights)
    x = torch.randn(1, 4, side, side, generator=g).to(device, dtype)
    with tempfile.TemporaryDirectory() as tmp, _copy_mode(kind):
        root = Path(tmp)
        save_model(ref, str(root / "model.safetensors"))
        lora = shuttle.load_lora(_write_lora(ref, root / "lora.safetensors", g))
        with torch.device("meta"):
            model = model_cls(4, dim, mlp, depth).to(dtype)
        file = SafetensorsFile(root / "model.safetensors")
        # The resident reference: the same weights and adapter, merged the same way.
        resident = ref.to(device)
        with torch.no_grad(), shuttle.apply_lora(resident, [(lora, 0.8)], mode="merge"):
            want = resident(x)
        ref.to("cpu")
        del resident
        if kind == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        handle = OffloadHandle({"model": model}, {"model": ["blocks"]},
                               cache=ModelCache(host_budget), device=device, prefetch=1,
                               vram_budget=vram_budget,
                               sources={"model": {k: file.tensor_ref(k) for k in file}})
        try:
            handle.set_loras([(lora, 0.8)])
            times, equal = [], True
            with torch.no_grad():
                for _ in range(4):  # the first call at the floor, then as planned with it
                    t, y = _timed(lambda: model(x), kind)
                    times.append(t)
                    equal = equal and torch.equal(y, want)
            off = handle.offloaders["model"]
            storage = off.storage
            host = handle.cache.used_bytes
            streamed = _streamed_bytes(off)
            peak = torch.cuda.max_memory_allocated(device) if kind == "cuda" else None
            read = storage.reader.bytes_read if storage.reader is not None else 0
            disk = read_bandwidth(root / "model.safetensors")  # as the disk tier reads it
        finally:
            handle.remove()
    seconds = statistics.median(times[1:])
    per_call = read / len(times)  # the first call reads as much as the others
    bound = max(streamed / _pinned_bandwidth(device) if kind == "cuda" else 0.0,
                per_call / disk)
    row = {
        "model": f"{format_bytes(weights)} ({depth} blocks)",
        "output equals resident": equal,
        "peak VRAM / budget": ("-" if peak is None else
                               f"{format_bytes(peak)} / {format_bytes(vram_budget)}"),
        "host bytes / max_host_bytes": f"{format_bytes(host)} / {format_bytes(host_budget)}",
        "read from disk": format_bytes(read),
        "ms / call": f"{seconds * 1e3:.1f}",
        "bound (ms)": f"{bound * 1e3:.1f}",
    }
    ok = equal and host <= host_budget and (peak is None or peak <= vram_budget)
    return row, ok


def _write_lora(model: torch.nn.Module, path: Path, g: torch.Generator) -> Path:
    """A kohya LoRA of rank 16 on every block's qkv and fc1 (factors of a trained size)."""
    tensors = {}
    for i, block in enumerate(model.blocks):
        for name, lin in (("attn_to_qkv", block.attn.to_qkv), ("mlp_fc1", block.mlp.fc1)):
            key = f"lora_unet_blocks_{i}_{name}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(16, lin.in_features,
                                                             generator=g) * 0.02
            tensors[f"{key}.lora_up.weight"] = torch.randn(lin.out_features, 16,
                                                           generator=g) * 0.02
            tensors[f"{key}.alpha"] = torch.tensor(16.0)
    save_file(tensors, str(path))
    return path


@contextlib.contextmanager
def _copy_mode(kind: str) -> Iterator[None]:
    """On the CPU, activations copy through slots and hooks as on CUDA (not in place)."""
    if kind == "cuda":
        yield
        return
    before = os.environ.get(CPU_COPY_ENV)
    os.environ[CPU_COPY_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[CPU_COPY_ENV]
        else:
            os.environ[CPU_COPY_ENV] = before


def _timed(call, kind: str) -> tuple[float, torch.Tensor]:
    if kind != "cuda":
        t0 = time.perf_counter()
        y = call()
        return time.perf_counter() - t0, y
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, y


def _streamed_bytes(off: ModelOffloader) -> int:
    """Bytes a call of the active ``off`` copies to the device: every streamed block once."""
    plan = off.plan
    assert plan is not None
    return sum(u.layout.nbytes for g, units in off.storage.groups.items()
               for i, u in enumerate(units) if i not in plan.resident[g])


def _pinned_bandwidth(device: str) -> float:
    """Bytes per second of a pinned host-to-device copy of 64 MiB (median of 5)."""
    src = torch.empty(64 * 2**20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    times = []
    for _ in range(6):
        t, _ = _timed(lambda: dst.copy_(src, non_blocking=True), "cuda")
        times.append(t)
    return src.numel() / statistics.median(times[1:])
