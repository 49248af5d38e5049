"""What every call that applies adapters reports, whatever it returns.

``merge_lora``, ``apply_lora`` (any mode), ``attach_lora``, ``load_checkpoint``, ``merge_files``
and ``unmerge_lora`` return different objects (a merge report, a dynamic handle, a load or file
report), each with what is particular to it. All of them answer the same four questions under
the same names, which :class:`AdapterReport` states, so code that checks an application does
not depend on how it was applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shuttle.apply.notes import Note

__all__ = ["AdapterReport"]


@runtime_checkable
class AdapterReport(Protocol):
    """The four answers of every adapter application.

    Attributes:
        applied: the parameters (or checkpoint tensors) that received an update.
        unmatched: adapter keys that reached no parameter -> why (prefixed ``source::`` when
            several adapters were applied).
        skipped: adapter keys ``load_lora`` did not turn into patches -> why.
        notes: where the update differs on purpose from a peer tool's
            (:class:`~shuttle.apply.notes.Note`).
    """

    @property
    def applied(self) -> list[str]: ...

    @property
    def unmatched(self) -> dict[str, str]: ...

    @property
    def skipped(self) -> dict[str, str]: ...

    @property
    def notes(self) -> list[Note]: ...
