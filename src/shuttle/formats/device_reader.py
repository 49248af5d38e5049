"""Read file-backed tensors onto a CUDA device through reused pinned staging buffers.

Reading each tensor into fresh host memory and copying it from there costs twice: first-touch
page faults on every new allocation (a few GB/s), then a pageable host-to-device copy, which the
driver stages through its own pinned buffer and which blocks the host. :class:`DeviceReader`
keeps two page-locked buffers sized to the largest tensor read so far and alternates between
them: the file is read into one while the other's asynchronous copy to the device runs. Host
memory stays at two tensors' worth whatever the checkpoint's size.
"""

from __future__ import annotations

import torch

from shuttle.formats.safetensors_file import LazyTensor

__all__ = ["DeviceReader"]


class DeviceReader:
    """Double-buffered reads of :class:`LazyTensor` onto ``device`` (a CUDA device).

    Each :meth:`read` returns a new device tensor whose copy is ordered on the current stream,
    so work queued after it on that stream sees the data; the host only waits when a staging
    buffer is about to be reused before its previous copy finished.
    """

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"DeviceReader stages copies to CUDA devices, not {device}")
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def read(self, ref: LazyTensor) -> torch.Tensor:
        i, self._turn = self._turn, 1 - self._turn
        if self._done[i] is not None:
            self._done[i].synchronize()  # its last copy must finish before it is overwritten
        buf = self._buffers[i]
        if buf is None or buf.numel() < ref.nbytes:
            self._buffers[i] = buf = torch.empty(max(ref.nbytes, 1), dtype=torch.uint8,
                                                 pin_memory=True)
        host = ref.load_into(buf)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._done[i] = done
        return out
