"""The work units of the CuTe LoRA GEMM (:mod:`shuttle.kernels.lora_gemm_sm90`) and their order.

Without the shrink the units are the output tiles, row tile by row tile. With it, the kernel
also computes S in units of its own (S tiles: ``tile.n`` tokens' S each), which the output tiles
of those rows read back once a flag says the tile is in memory (a row tile straddling two S
tiles, where ``tile.n`` is no multiple of ``tile.m``, waits for both): the S tile's store warp
waits until its bulk stores are complete and releases the flag (gpu scope); a reader's producer
acquires it before its S/B loads, and the tile's last reader resets it for the next launch
(graph replays included). The order, fixed on the host as a work list of int32 codes, puts each
S tile before its readers, early enough that they seldom wait: a CTA only ever waits on a unit
taken before its own, so with every CTA resident (one per SM) there is no deadlock.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

__all__ = ["L2_AHEAD_BYTES", "S_UNIT", "UNIT_FIELD", "WorkLists", "s_blocks_of", "s_tiles_ahead",
           "s_tiles_of", "shrink_work_list", "unit_of"]

# A unit's code: an S tile's index + S_UNIT, or an output tile's row tile * UNIT_FIELD + its
# column tile.
S_UNIT = 1 << 30
UNIT_FIELD = 1 << 15
# How many bytes of x the S tiles may read ahead of their readers (the output tiles read those
# rows again: they should still be in L2, beside the weight's tiles: tens of MB on Hopper).
L2_AHEAD_BYTES = 16 << 20


def s_tiles_ahead(sms: int, readers: float, x_bytes: int) -> int:
    """How many S tiles the work list places ahead (``ahead`` of :func:`shrink_work_list`) for
    ``sms`` CTAs, ``readers`` output tiles per S tile (on average) and ``x_bytes`` of x per S
    tile.

    Placed ``ahead`` S tiles early, an S tile precedes its first reader by ``ahead - 1`` S
    tiles' readers: at least a round of the SMs and a quarter (CTAs drift apart), so that it is
    done when read, as far as the rows of x it read stay in L2 until read again
    (:data:`L2_AHEAD_BYTES`).
    """
    rounds = math.ceil(5 * sms / (4 * readers)) + 1
    return max(1, min(rounds, L2_AHEAD_BYTES // x_bytes))


def s_tiles_of(m: int, tile_m: int, tile_n: int) -> range:
    """The S tiles (``tile_n`` tokens each) that row tile ``m`` (``tile_m`` rows) reads: one,
    or two where it straddles their boundary (``tile_n`` not a multiple of ``tile_m``).
    """
    return range(m * tile_m // tile_n, (m * tile_m + tile_m - 1) // tile_n + 1)


def s_blocks_of(m_blocks: int, tile_m: int, tile_n: int) -> int:
    """How many S tiles cover ``m_blocks`` row tiles."""
    return -(-m_blocks * tile_m // tile_n)


def shrink_work_list(m_blocks: int, tiles_n: int, tile_m: int, tile_n: int,
                     ahead: int) -> list[int]:
    """The shrink form's units in the order CTAs take them: output tiles row tile by row tile
    (``tile_m`` rows, ``tiles_n`` column tiles each), with each S tile (``tile_n`` tokens' S)
    placed ``ahead`` S tiles before the first of its readers.

    Codes as the kernel reads them: an S tile ``j`` is ``S_UNIT + j``, output tile (m, n)
    ``m * UNIT_FIELD + n``. Every S tile precedes its readers, so a CTA waiting for one waits
    for a unit another CTA has already taken (all CTAs are resident): no deadlock.
    """
    if m_blocks >= UNIT_FIELD or tiles_n >= UNIT_FIELD:
        raise ValueError(f"{m_blocks} row tiles x {tiles_n} column tiles: the work list's "
                         f"fields take fewer than {UNIT_FIELD} each")
    s_blocks = s_blocks_of(m_blocks, tile_m, tile_n)
    codes: list[int] = []
    placed = 0
    for m in range(m_blocks):
        # the row tile's last S tile and the ``ahead - 1`` after it already placed
        due = min(s_blocks, s_tiles_of(m, tile_m, tile_n)[-1] + ahead)
        codes.extend(S_UNIT + j for j in range(placed, due))
        placed = max(placed, due)
        codes.extend(m * UNIT_FIELD + n for n in range(tiles_n))
    return codes


def unit_of(u: Any, table: Any, tiles_n: Any, shrink: bool) -> tuple:
    """(S tile or not, row tile, column tile) of work unit ``u`` (traced into the kernel; an S
    tile's column tile is its index, tile.n tokens each): the shrink's work list says, else the
    units are the output tiles in row-major order.
    """
    if shrink:
        code = table[u]
        return code >= S_UNIT, (code // UNIT_FIELD) % UNIT_FIELD, code % UNIT_FIELD
    return False, u // tiles_n, u % tiles_n


class WorkLists:
    """The shrink form's work lists on one device, shared by every layer of a shape, and the
    flags their S tiles raise.

    A list depends on (row tiles, column tiles, the tile's rows, its columns (an S tile's
    tokens), ``ahead``): one per distinct row count and layer shape, made on first use. Made
    lists are kept up to ``capacity`` in least-recently-used order, except those a CUDA graph
    captured (a replay reads the list by its address: it stays for the process). None is made
    while a graph is being captured (an upload is no operation a capture takes): :meth:`get`
    answers None and the caller runs another path for that call.

    The flags are one buffer per device for every list and layer, ``2 * UNIT_FIELD`` int32
    (two per S tile, the most a list has), made with the first list: zero between launches
    (each S tile's last reader resets its own), so launches in one stream order share it.
    """

    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        self.device = device
        self.capacity = capacity
        self.flags: torch.Tensor | None = None
        self._lists: collections.OrderedDict[tuple, tuple[torch.Tensor, int, int]] = \
            collections.OrderedDict()
        self._captured: dict[tuple, tuple[torch.Tensor, int, int]] = {}

    def get(self, m_blocks: int, tiles_n: int, tile_m: int, tile_n: int, ahead: int, *,
            capturing: bool = False) -> tuple[torch.Tensor, int, int] | None:
        """(the list on the device, its units, its S tiles); None while ``capturing`` where
        the list was not made before.
        """
        key = (m_blocks, tiles_n, tile_m, tile_n, ahead)
        got = self._captured.get(key) or self._lists.get(key)
        if got is None:
            if capturing:
                return None
            codes = shrink_work_list(m_blocks, tiles_n, tile_m, tile_n, ahead)
            if self.flags is None:
                self.flags = torch.zeros(2 * UNIT_FIELD, dtype=torch.int32, device=self.device)
            got = (torch.tensor(codes, dtype=torch.int32, device=self.device), len(codes),
                   s_blocks_of(m_blocks, tile_m, tile_n))
            self._lists[key] = got
            while len(self._lists) > self.capacity:
                self._lists.popitem(last=False)
        elif key in self._lists:
            self._lists.move_to_end(key)
            if capturing:  # kept for the process: a replay reads it
                self._captured[key] = self._lists.pop(key)
        return got

    def __len__(self) -> int:
        return len(self._lists) + len(self._captured)
