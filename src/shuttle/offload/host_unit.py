"""A captured unit's host side: its layout, the tensors kept for it on the host (an arena's
views, adopted tensors, or maps of its files while it waits on disk), and where they plug into
the model (:meth:`HostUnit.bind`). :class:`~shuttle.offload.host_storage.HostStorage` captures
the units and decides where each one's bytes live.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shuttle.offload.coded import Decoder, UnitCode
from shuttle.offload.disk_reader import DiskReader, DiskSpans
from shuttle.offload.layout import Layout
from shuttle.offload.survey import Binding, UnitSurvey
from shuttle.weights.dtensor import bind_local

__all__ = ["HostUnit"]


class HostUnit:
    """One captured unit: its layout, host tensors, and where they plug into the model."""

    def __init__(self, name: str, layout: Layout, bindings: list[Binding],
                 host_views: list[torch.Tensor], arena: torch.Tensor | None):
        self.name = name
        self.layout = layout
        self.bindings = bindings
        self.host_views = host_views  # per layout entry: the tensor kept on the host
        self.arena = arena  # the flat host buffer (None when adopted or on disk)
        # A unit that can be re-read from its files (a host ceiling): where its tensors lie,
        # and the reader that loads it while it has no arena.
        self.spans: DiskSpans | None = None
        # its side entries (layout entry -> host tensor): what a read of its files does not
        # give as the unit holds it (shuttle.offload.spill.side_entries), copied after a load
        self.side: dict[int, torch.Tensor] = {}
        self.reader: DiskReader | None = None
        self.survey: UnitSurvey | None = None  # what to read it from (to fill an arena)
        self.code: UnitCode | None = None  # the arena is coded (compress="lossless")
        # Under a ceiling: the code its file holds it in (read so from disk; None: plain), and
        # with compress, the code an arena for it will hold (sized while it is on disk).
        self.disk_code: UnitCode | None = None
        self.planned: UnitCode | None = None

    @property
    def on_disk(self) -> bool:
        """Whether the unit has no host copy: each load reads it from its files."""
        return self.arena is None and self.spans is not None

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        """Point the unit's parameters (``.data``; identity kept) and buffers at ``views``.

        A parameter on the ``meta`` device (a model filled from its files) has no data to
        re-point: it is replaced, once, by a parameter of ``views`` (tied names share it); so
        is a real one bound to ``meta`` views (such a model given back empty).

        A quantized parameter is rebound through its representation: its data and every side
        tensor (``quant_state``, scales) point at their views together.
        """
        parts: dict[tuple[int, str], tuple[Binding, dict[str, torch.Tensor]]] = {}
        real: dict[int, torch.nn.Parameter] = {}  # a meta parameter -> the one replacing it
        for b in self.bindings:
            if b.rep is not None:
                parts.setdefault((id(b.module), b.name), (b, {}))[1][b.part] = views[b.entry]
            elif b.shard:  # the DTensor object (and its Parameter identity) stays
                table = b.module._parameters if b.is_param else b.module._buffers
                bind_local(table[b.name], views[b.entry])
            elif b.is_param:
                p = b.module._parameters[b.name]
                if p.is_meta != views[b.entry].is_meta:  # replaced once (tied names share it)
                    if id(p) not in real:
                        real[id(p)] = torch.nn.Parameter(views[b.entry], p.requires_grad)
                    b.module._parameters[b.name] = real[id(p)]
                else:
                    p.data = views[b.entry]
            else:
                b.module._buffers[b.name] = views[b.entry]
        for b, tensors in parts.values():
            b.rep.rebind(b.module._parameters[b.name], tensors)

    def bind_host(self) -> None:
        """Point the unit back at its host tensors."""
        self.bind(self.host_views)

    def host_tensors(self) -> list[torch.Tensor]:
        """Per layout entry, the tensor's values on the host (a coded unit's decoded into
        fresh memory; else :attr:`host_views`).
        """
        if self.code is None:
            return list(self.host_views)
        assert self.arena is not None
        return self.code.decoded(self.layout, self.arena)

    def copy_into(self, flat: torch.Tensor, views: Sequence[torch.Tensor],
                  non_blocking: bool, decoder: Decoder | None = None
                  ) -> torch.cuda.Stream | None:
        """Copy the host tensors into a device buffer laid out by :attr:`layout`.

        One copy of the whole arena when there is one; one per tensor when adopted; a coded
        arena through ``decoder``. A unit on disk is loaded through its reader instead
        (:class:`~shuttle.offload.slots.SlotPool`).

        Returns:
            The stream whose queued work completes the buffer when that is not the current
            one (a coded unit's decode stream), else None.
        """
        assert not self.on_disk, f"{self.name} is on disk: load it through its reader"
        if self.code is not None:
            assert decoder is not None and self.arena is not None, f"{self.name} is coded"
            return decoder.load(self.code, self.layout, self.arena, flat, views, non_blocking)
        if self.arena is not None:
            flat.copy_(self.arena, non_blocking=non_blocking)
        else:
            for dst, src in zip(views, self.host_views, strict=True):
                dst.copy_(src, non_blocking=non_blocking)
        return None
