"""Host arenas: one uninitialised buffer per unit (transparent huge pages where large), and
page-locking exactly its pages with ``cudaHostRegister`` (``pin_memory()`` would round each
allocation up to a power of two, up to 2x).
"""

from __future__ import annotations

import mmap
import warnings

import torch

__all__ = ["PAGE", "new_arena", "register_pages", "unregister_pages"]

PAGE = 4096
HUGE = 2 * 2**20  # a transparent huge page


def new_arena(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised host buffer for ``nbytes``: exactly that without ``pin``; to be pinned,
    page-aligned and a whole number of pages (no registered page shared with other memory).

    Large arenas are anonymous maps advised to use transparent huge pages: the first touch of
    each 2 MiB page is one fault instead of 512, so the copy into a fresh arena spends less
    time in the kernel (docs/benchmarks/offload_capture.md).
    """
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    size = -(-nbytes // PAGE) * PAGE
    if size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(m, dtype=torch.uint8)  # keeps the map alive while used
        shift = (-raw.data_ptr()) % HUGE
        return raw[shift:shift + size]
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    return raw[shift:shift + size]


def register_pages(arena: torch.Tensor, registered: list[int]) -> bool:
    """Page-lock ``arena`` (whole pages, exactly its bytes); False, with a warning, on failure.

    Called after the arena is filled: registering pins pages that are already there, while
    registering first would fault every page in through the driver, 4-5x slower in all.
    """
    err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
    if int(err) != 0:
        warnings.warn(f"cudaHostRegister of {arena.numel()} bytes failed ({err}); this unit "
                      "stays in pageable memory (slower copies). Raise the locked-memory limit "
                      "(ulimit -l) or use host='adopt'.", RuntimeWarning, stacklevel=4)
        return False
    registered.append(arena.data_ptr())  # list.append is atomic: workers share the list
    return True


def unregister_pages(ptrs: list[int]) -> None:
    """Undo :func:`register_pages` for the arenas starting at ``ptrs``."""
    for p in ptrs:
        torch.cuda.cudart().cudaHostUnregister(p)
