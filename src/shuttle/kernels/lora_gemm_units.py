"""The work units of the CuTe LoRA GEMM (:mod:`shuttle.kernels.lora_gemm_sm90`) and their order.

Without the shrink the units are the output tiles, row tile by row tile. With it, the kernel
also computes S in units of its own (S tiles: ``tile.n`` tokens' S each), which the output tiles
of those rows read back once a flag says the tile is in memory; the order, fixed on the host as
a work list of int32 codes, puts each S tile early enough that its readers seldom wait.
"""

from __future__ import annotations

from typing import Any

__all__ = ["L2_AHEAD_BYTES", "S_UNIT", "UNIT_FIELD", "s_tiles_ahead", "shrink_work_list",
           "unit_of"]

# A unit's code: an S tile's index + S_UNIT, or an output tile's row tile * UNIT_FIELD + its
# column tile.
S_UNIT = 1 << 30
UNIT_FIELD = 1 << 15
# How many bytes of x the S tiles may read ahead of their readers (the output tiles read those
# rows again: they should still be in L2, 50 MB on an H100, beside the weight's tiles).
L2_AHEAD_BYTES = 16 << 20


def s_tiles_ahead(sms: int, readers: int, x_bytes: int) -> int:
    """How many S tiles the work list places ahead (``ahead`` of :func:`shrink_work_list`) for
    ``sms`` CTAs, ``readers`` output tiles per S tile and ``x_bytes`` of x per S tile.

    Placed ``ahead`` S tiles early, an S tile precedes its first reader by ``ahead - 1`` S
    tiles' readers: at least a round of the SMs and a quarter (CTAs drift apart), so that it is
    done when read, as far as the rows of x it read stay in L2 until read again
    (:data:`L2_AHEAD_BYTES`).
    """
    rounds = -(-5 * sms // (4 * readers)) + 1
    return max(1, min(rounds, L2_AHEAD_BYTES // x_bytes))


def shrink_work_list(m_blocks: int, tiles_n: int, per_s: int, ahead: int) -> list[int]:
    """The shrink form's units in the order CTAs take them: output tiles row block by row
    block (``tiles_n`` column tiles each), with each S tile (``per_s`` row blocks' S) placed
    ``ahead`` S tiles before the first of its readers.

    Codes as the kernel reads them: an S tile ``j`` is ``S_UNIT + j``, output tile (m, n)
    ``m * UNIT_FIELD + n``. Every S tile precedes its readers, so a CTA waiting for one waits
    for a unit another CTA has already taken (all CTAs are resident): no deadlock.
    """
    if m_blocks >= UNIT_FIELD or tiles_n >= UNIT_FIELD:
        raise ValueError(f"{m_blocks} row tiles x {tiles_n} column tiles: the work list's "
                         f"fields take fewer than {UNIT_FIELD} each")
    s_blocks = -(-m_blocks // per_s)
    codes = [S_UNIT + j for j in range(min(ahead, s_blocks))]
    for j in range(s_blocks):
        for m in range(j * per_s, min((j + 1) * per_s, m_blocks)):
            codes.extend(m * UNIT_FIELD + n for n in range(tiles_n))
        if j + ahead < s_blocks:
            codes.append(S_UNIT + j + ahead)
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
