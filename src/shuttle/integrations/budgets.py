"""What an offload is given before anything is captured: the device checked, the host budget
read (``"auto"``: what this machine has available) and made a cache, and, when modules built
from their files do not all fit in that budget, each one's share of it (:func:`host_shares`) and
the cache entry that captures it under its share (:class:`SourcedSpec`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shuttle.byte_count import ByteCount, byte_count
from shuttle.cache import ModelCache
from shuttle.cache.specs import capture_bar, module_bytes
from shuttle.errors import (
    BudgetTooSmallError,
    CacheError,
    DeviceUnavailableError,
    HostMemoryError,
    OffloadError,
)
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.offload import ModelOffloader
from shuttle.offload.coded import Compression
from shuttle.offload.host_memory import HOST_RESERVE, available_host_bytes
from shuttle.offload.host_storage import HostBacking
from shuttle.offload.spill import convert_hint

__all__ = ["NO_CEILING", "VRAM_RESERVE", "SourcedSpec", "byte_budgets", "cache_for", "check_device",
           "check_host_room", "files_ceiling", "host_shares", "read_order"]

NO_CEILING = sys.maxsize  # the budget of a cache without a ceiling
VRAM_RESERVE = 2**29  # the least of a device's free memory vram_budget="auto" leaves unused


def check_device(device: str | torch.device, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` this machine has, else :class:`DeviceUnavailableError`.

    ``"cuda"`` on a machine (or a torch build) without CUDA, ``"cuda:3"`` with two GPUs, or a
    name torch does not know are refused here, before anything moves.
    """
    shown = str(device) if isinstance(device, torch.device) else device
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceUnavailableError(
            f"{what}={shown!r} is not a device name torch knows; pass 'cuda', 'cuda:0' "
            "or 'cpu'."
        ) from None
    if d.type in ("cpu", "meta"):
        return d
    backend = getattr(torch, d.type, None)
    available = backend is not None and getattr(backend, "is_available", lambda: False)()
    if not available:
        raise DeviceUnavailableError(
            f"{what}={shown!r}: this machine has no {d.type} device (torch {torch.__version__} "
            f"sees none); run where one is visible (check CUDA_VISIBLE_DEVICES and that torch "
            "was built with CUDA), or pass 'cpu'."
        )
    count = getattr(backend, "device_count", lambda: 1)()
    if d.index is not None and d.index >= count:
        raise DeviceUnavailableError(
            f"{what}={shown!r}: this machine has {count} {d.type} device(s), "
            f"{d.type}:0..{d.type}:{count - 1}; pass one of those."
        )
    return d


def byte_budgets(vram_budget: ByteCount | None, max_host_bytes: ByteCount | None,
                 device: torch.device | None = None) -> tuple[int | None, int | None]:
    """``vram_budget`` and ``max_host_bytes`` as whole bytes (None stays None), read as
    :func:`~shuttle.byte_count.byte_count` reads them (``6 * 2**30``, ``6e9``, ``"6GiB"``), so
    that a bad one is refused before anything is built or read.

    ``"auto"`` is what the machine has free as the call starts: for ``max_host_bytes`` the
    host memory available (:func:`~shuttle.offload.host_memory.available_host_bytes`, within a
    container's limit) less ``HOST_RESERVE`` for the process itself; for ``vram_budget`` the
    free memory of ``device`` (a CUDA device) less a tenth of it, at least ``VRAM_RESERVE``
    (what the allocator's blocks lose to fragmentation, and libraries that allocate outside
    it).

    Raises:
        OffloadError: a ``vram_budget`` that is not a number of bytes >= 0, or ``"auto"`` for
            a device that is not CUDA, or with no more than the reserve free.
        CacheError: a ``max_host_bytes`` that is not (as a new cache's budget refuses it).
        HostMemoryError: ``"auto"`` where the system does not say what is available, or where
            less than the reserve is.
    """
    if _is_auto(vram_budget):
        vram = _auto_vram_budget(device)
    else:
        vram = None if vram_budget is None else byte_count(vram_budget, "vram_budget",
                                                           OffloadError)
    if _is_auto(max_host_bytes):
        return vram, _auto_host_bytes()
    host = None if max_host_bytes is None else byte_count(max_host_bytes, "max_host_bytes",
                                                          CacheError)
    return vram, host


def _is_auto(budget: ByteCount | None) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == "auto"


def _auto_vram_budget(device: torch.device | None) -> int:
    if device is None or device.type != "cuda":
        raise OffloadError(f"vram_budget='auto' is the free memory of a CUDA device, and "
                           f"device={str(device)!r} is not one; give vram_budget in bytes "
                           "(\"6GiB\") or None")
    free, _ = torch.cuda.mem_get_info(device)
    reserve = max(VRAM_RESERVE, free // 10)
    if free <= reserve:
        raise OffloadError(f"vram_budget='auto': {_gb(free)} is free on {device}, no more than "
                           f"the {_gb(reserve)} kept for the allocator; free device memory (other "
                           "processes: nvidia-smi) or give vram_budget in bytes")
    return free - reserve


def _auto_host_bytes() -> int:
    available = available_host_bytes()
    if available is None:
        raise HostMemoryError("max_host_bytes='auto': this system does not say how much memory "
                              "is available (no /proc/meminfo); give max_host_bytes as a number "
                              "of bytes (\"12GiB\")")
    if available <= HOST_RESERVE:
        raise HostMemoryError(
            f"max_host_bytes='auto': {_gb(available)} of host memory is available, no more "
            f"than the {_gb(HOST_RESERVE)} kept for the process itself (CUDA, the libraries); "
            "free memory (close other programs) or give max_host_bytes as a number of bytes")
    return available - HOST_RESERVE


def check_host_room(needed: int, who: str) -> None:
    """Refuse to hold ``needed`` bytes of weights in host memory without a ceiling
    (``max_host_bytes=None``) where this machine has not that much available beside
    ``HOST_RESERVE``: pinned pages are never reclaimed, so such a load would end in the
    out-of-memory killer, not in an error. Nothing is checked where the system does not say.

    Raises:
        HostMemoryError: naming the bytes needed and available, and the ceiling to give.
    """
    available = available_host_bytes()
    if available is None or needed <= available - HOST_RESERVE:
        return
    raise HostMemoryError(
        f"{who}: holding every weight in host memory (no max_host_bytes) takes {_gb(needed)}, "
        f"and this machine has {_gb(available)} available, {_gb(HOST_RESERVE)} of it kept for "
        "the process itself; pass max_host_bytes='auto' (hold what fits, read the rest from "
        "the files on every pass) or a smaller number of bytes (\"8GiB\")")


def files_ceiling(max_host_bytes: int | None, cache: ModelCache | None,
                  modules: Iterable[torch.nn.Module], compress: Compression | None,
                  who: str) -> int | None:
    """The host budget of modules about to be read from their files: ``max_host_bytes`` as
    given (with or without ``cache``); with neither, no ceiling (``NO_CEILING``), once
    :func:`check_host_room` found room for their weights (bytes at their stored dtypes; coded
    ones, ``compress``, take less than can be told before they are coded: not checked).

    Raises:
        HostMemoryError: no ceiling given, and the weights do not fit in what is available.
    """
    if max_host_bytes is not None or cache is not None:
        return max_host_bytes
    if compress is None:
        check_host_room(sum(module_bytes(m) for m in modules), who)
    return NO_CEILING


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def cache_for(max_host_bytes: int | None, cache: ModelCache | None) -> ModelCache:
    """The cache an ``offload`` call uses: a new one of ``max_host_bytes``, or ``cache``.

    Raises:
        CacheError: both or neither given.
    """
    if (max_host_bytes is None) == (cache is None):
        raise CacheError(f"max_host_bytes={max_host_bytes!r}, cache={cache!r}: give exactly "
                         "one (a byte budget for a new cache, or a ModelCache to share)")
    return cache if cache is not None else ModelCache(max_host_bytes)  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class SourcedSpec:
    """A module captured straight from its checkpoint files, under a host ceiling or not."""

    key: str
    module: torch.nn.Module
    blocks: tuple[str, ...]
    host: HostBacking
    sources: Mapping[str, LazyTensor]
    max_host_bytes: int | None
    floor: int | None  # with a ceiling: the bytes charged (the rest of it is a reservation)
    compress: Compression | None = None

    @property
    def estimated_bytes(self) -> int | None:
        return self.max_host_bytes

    def build(self) -> ModelOffloader:
        weights = module_bytes(self.module)
        # coded units hold more weight bytes than their arenas take: the ceiling bounds no count
        expected = weights if self.max_host_bytes is None or self.compress else \
            min(weights, self.max_host_bytes)
        with capture_bar(f"reading {self.key}", expected, self.host == "adopt") as bar:
            return ModelOffloader.from_module(self.module, blocks=self.blocks, host=self.host,
                                              sources=self.sources,
                                              max_host_bytes=self.max_host_bytes,
                                              compress=self.compress, progress=bar.update)

    def nbytes(self, value: ModelOffloader) -> int:
        s = value.storage
        if self.floor is not None:  # what the share can never go below; the rest reserved
            return self.floor
        return s.host_bytes if s.host == "pinned" else s.weight_bytes


def read_order(names: Sequence[str], blocks: Mapping[str, Sequence[str]],
               hot: Sequence[str] = ()) -> list[str]:
    """``names``, the modules whose weights are read most often in a call first: those in
    ``hot`` (a pipeline's denoisers, run at every step), then the others with streamed blocks
    (text encoders under a VRAM budget: run once a call), then the ones moved whole; in order
    within each.

    Host memory goes to the first (:func:`host_shares`) and is taken back from the last
    (``OffloadHandle.set_loras``): a byte kept in host memory saves one disk read per call of
    its module, so with Flux at a 4 step call the transformer's bytes save four reads each and
    T5's one.
    """
    return sorted(names, key=lambda n: (n not in hot, not blocks.get(n)))


def host_shares(modules: Mapping[str, torch.nn.Module], blocks: Mapping[str, Sequence[str]],
                 host: HostBacking, sources: Mapping[str, Mapping[str, LazyTensor]],
                 budget: int, hot: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
    """Name -> (host share, floor) of each module captured from files, when the modules do not
    all fit in ``budget`` whole; empty when they do (or nothing could stay on disk).

    Every module gets its floor first (a module without files: everything), then the others'
    shares grow in :func:`read_order` (``hot`` first), each up to what keeps it whole.

    Raises:
        BudgetTooSmallError: ``budget`` cannot hold the floors.
    """
    if host != "pinned" or not any(n in sources for n in modules):
        return {}
    needs = {n: ModelOffloader.host_needs(m, tuple(blocks.get(n, ())), sources=sources.get(n))
             for n, m in modules.items()}
    if sum(x.everything for x in needs.values()) <= budget:
        return {}
    floors = {n: x.floor if n in sources else x.everything for n, x in needs.items()}
    if sum(floors.values()) > budget:
        raise BudgetTooSmallError(
            f"max_host_bytes: {budget} free bytes in the cache cannot hold the modules' host "
            f"floors {floors} (what must stay in host memory plus a staging buffer): give at "
            f"least {sum(floors.values())} bytes"
            + convert_hint(sum(x.converted for n, x in needs.items() if n in sources)))
    left = budget - sum(floors.values())
    shares = dict(floors)
    for n in read_order([n for n in modules if n in sources], blocks, hot):
        extra = max(0, min(left, needs[n].everything - floors[n]))
        shares[n] += extra
        left -= extra
    return {n: (shares[n], floors[n]) for n in modules if n in sources}
