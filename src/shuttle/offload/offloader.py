"""``ModelOffloader``: a model kept in host memory, put on a device whole or block by block.

``from_module`` captures every parameter and buffer once (:class:`HostStorage`). Each
``activate`` (or ``use``) then places the model on a device for a while:

* without a :class:`StreamConfig`: every unit (the rest of the model and each block) is copied
  into its own device buffer, one copy per unit;
* with one: the rest of the model and the resident blocks are copied once; every other block
  streams through a fixed ring of slots (:class:`BlockStreamer`), ``prefetch`` blocks ahead.

Models without block lists use layer mode (``from_module(..., layers=True)``): every leaf
module with parameters of its own is a unit, and with a :class:`StreamConfig` the layers stream
through one ring of equal slots (:class:`~shuttle.offload.layer_streamer.LayerStreamer`).
Blocks and layers combine: layers are chosen outside the blocks.

Training goes through streamed blocks with activation checkpointing; :meth:`optimizer_step`
makes the optimizer update the host copies (:mod:`shuttle.offload.training`).
``StreamConfig(compile=...)`` compiles block forwards (:mod:`shuttle.offload.compiled`).

Either can apply adapters for the activation (``loras=``): merged into each weight as its copy
lands (``mode="merge"``), added at forward time (``"dynamic"``), or each where it keeps
the update (``"auto"``); see
:mod:`shuttle.offload.adapters`. The host copy is never modified.

With ``from_module(..., sources=..., max_host_bytes=...)`` host memory has a ceiling: the units
that do not fit keep only where their tensors lie in the files and are read from there at each
load, through a staging ring (:mod:`shuttle.offload.disk_reader`). Which units keep host arenas
is the plan's host tier (:func:`~shuttle.offload.residency.plan_host`), applied at activation.

``deactivate`` points every tensor back at host storage and drops the device buffers. On the
CPU, activation is a pass-through (the host tensors are already where compute runs), unless the
test-only environment variable ``SHUTTLE_OFFLOAD_CPU_COPY=1`` is set: then CPU activation copies
through the same slots and hooks as CUDA does, so CI exercises the streaming logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal

import torch

from shuttle.apply.auto import DEFAULT_THRESHOLD, check_threshold
from shuttle.apply.dynamic_layer import Quality
from shuttle.apply.plan import AdapterList, Mode, check_mode, normalize_loras
from shuttle.byte_count import ByteCount, byte_count
from shuttle.errors import (
    AlreadyActiveError,
    BudgetTooSmallError,
    OffloadError,
    StreamModeError,
)
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.offload.activation import CPU_COPY_ENV, Activation, move
from shuttle.offload.adapters import ActivationAdapters, check_quality, former_mode
from shuttle.offload.compiled import BlockCompiler
from shuttle.offload.host_storage import (
    Compression,
    HostBacking,
    HostNeeds,
    HostStorage,
)
from shuttle.offload.layer_streamer import LayerStreamer
from shuttle.offload.residency import (
    ResidencyPlan,
    StreamConfig,
    check_given_plan,
    plan_residency,
)
from shuttle.offload.streamer import BlockStreamer, Streamer
from shuttle.offload.training import host_step
from shuttle.offload.units import units_of
from shuttle.targets import KeyMapping

__all__ = ["CPU_COPY_ENV", "ModelOffloader", "ResidencyPlan", "StreamConfig"]



class ModelOffloader:
    """A model in host memory, activated on a device whole or with streamed blocks.

    Build with :meth:`from_module`. Uses are sequential: one activation at a time.

    Attributes:
        model: the wrapped model (the same object, its tensors now in host storage).
        storage: the host storage (``host_bytes``, ``pinned_bytes``, ``weight_bytes``).
        on_device: with ``trainable="device"``: the trainable parameters, kept out of host
            storage and moved whole to the device for each activation.
        blocks: block path -> the blocks streamed from it.
        layers: layer mode: module path -> each layer streamed on its own (empty otherwise).
    """

    def __init__(self, model: torch.nn.Module, blocks: dict[str, list[torch.nn.Module]],
                 storage: HostStorage, layers: dict[str, torch.nn.Module] | None = None,
                 on_device: Sequence[torch.nn.Parameter] = ()):
        self.model = model
        self.blocks = blocks
        self.layers = layers or {}
        self.storage = storage
        self.on_device = list(on_device)
        self._active: Activation | None = None

    @classmethod
    def from_module(cls, model: torch.nn.Module, blocks: str | Sequence[str] = (),
                    host: HostBacking = "pinned",
                    layers: bool | Sequence[type[torch.nn.Module]] = False,
                    trainable: Literal["host", "device"] = "host",
                    sources: Mapping[str, LazyTensor] | None = None,
                    max_host_bytes: ByteCount | None = None,
                    compress: Compression | None = None,
                    progress: Callable[[int], None] | None = None) -> ModelOffloader:
        """Capture ``model``'s parameters and buffers into host storage.

        Args:
            model: the model; its parameters keep their identity (``.data`` is re-pointed).
            blocks: dotted paths of ``nn.ModuleList``/``nn.Sequential`` whose entries may
                stream; each path is its own group. Its blocks may differ (T5's first block
                holds the relative attention bias, a UNet's stages differ in width): they
                stream through one ring of slots sized by the largest streamed block, and a
                resident block takes its own size.
            host: ``"pinned"`` (page-locked copies, at most one arena per block; pageable
                originals freed as copied) or ``"adopt"`` (keep the CPU tensors, zero-copy).
            layers: layer mode, for models without block lists (or for what lies outside
                them). ``True``: every leaf module outside the blocks with parameters of its
                own is a layer, its parameters one unit (buffers stay with the rest); a
                sequence of module classes (``(nn.Linear, nn.Conv2d)``): only instances of
                those. Modules whose parameters are tied to another module's stay with the
                rest (resident).
            trainable: where the parameters with ``requires_grad`` (at this call) live.
                ``"host"``: captured like the rest; streamed with their blocks, their host
                copies updated by :meth:`optimizer_step`. ``"device"``: left out of host
                storage and moved to the device for each activation (and back to the CPU
                after it), so that a LoRA's factors stay resident while the frozen blocks
                stream, forward and backward, and the optimizer runs on the device as for any
                model (its state on the device too); the VRAM budget counts them.
            sources: qualified tensor name -> its tensor in a safetensors checkpoint
                (``SafetensorsFile.tensor_ref``): captured straight from the file, so the
                model may be built on the ``meta`` device (see :class:`HostStorage`).
            max_host_bytes: a ceiling on the host memory the offloader holds (arenas and
                staging buffers; ``host="pinned"``). Units whose tensors all come from
                ``sources`` stay on disk when they do not fit, and are read from their files
                at every load through a pinned staging ring; the others (tensors the files
                lack, parameters trained on the host) always stay in host memory. Arenas go
                first to the units read most often; each activation's plan
                (:meth:`plan_for`) says which (``plan.pinned``). None: everything in host memory.
                Bytes, or as :func:`~shuttle.byte_count.byte_count` reads them (``"16GiB"``).
            compress: ``"lossless"``: keep the bfloat16/float16 weights coded in host memory
                (about 0.7x the bytes, in host memory and over the bus) and decode them on the
                device as they land, bit for bit (:mod:`shuttle.offload.coded`). Needs
                ``host="pinned"``. With ``max_host_bytes``, the arenas hold units coded (more
                of them fit) and the units left on disk are read as their files hold them (a
                file written by ``shuttle compress`` is read coded: fewer bytes from disk).
                While inactive, coded weights read as NaN on the host; activate to use them.
            progress: called with the weight bytes of each unit as it is read into host
                memory, during this call only (``tqdm(...).update``; the units a ceiling
                leaves on disk are not): bytes summing to those of the units in host memory
                when it returns.

        Raises:
            BlockPathError: a path names nothing, or not a non-empty block list, or two paths
                overlap.
            BlockLayoutError: a tensor is tied across units (a block and the rest, or two
                blocks).
            HostBackingError: a tensor that cannot be kept as ``host`` asks,
                ``max_host_bytes`` with ``host="adopt"``, or ``compress`` other than
                ``"lossless"`` or with ``host="adopt"``.
            BudgetTooSmallError: ``max_host_bytes`` cannot hold the units that must stay in
                host memory plus one staging buffer (the message names that floor).
            OffloadError: an unknown ``host``, a ``max_host_bytes`` that is not a number of
                bytes >= 0, a ``layers`` that is not a bool or a sequence
                of module classes, ``layers`` that selects no module, a model under FSDP2,
                or ``trainable="device"`` with trainable DTensor parameters.
            Nothing is changed when any of these is raised.

        DTensor parameters (tensor parallelism) are captured as their local shards: each rank
        pins and streams what it holds.
        """
        if host not in ("pinned", "adopt"):
            raise OffloadError(f"host={host!r}: expected 'pinned' (copies) or 'adopt' "
                               "(keep the CPU tensors)")
        if trainable not in ("host", "device"):
            raise OffloadError(f"trainable={trainable!r}: expected 'host' (captured and "
                               "streamed like the rest) or 'device' (kept on the device)")
        if max_host_bytes is not None:
            max_host_bytes = byte_count(max_host_bytes, "max_host_bytes", OffloadError)
        groups, chosen, on_device = units_of(model, blocks, layers, trainable)
        storage = HostStorage(model, groups, host, chosen, skip=on_device, sources=sources,
                              max_host_bytes=max_host_bytes, compress=compress,
                              progress=progress)
        off = cls(model, groups, storage, chosen, on_device)
        if max_host_bytes is not None:  # until a plan says otherwise: as if everything streams
            default = off.plan_for(StreamConfig() if groups or chosen else None)
            storage.settle(default.pinned, default.staging)
        storage.progress = None  # later plans' reads are not this load's
        return off

    @staticmethod
    def host_needs(model: torch.nn.Module, blocks: str | Sequence[str] = (),
                   layers: bool | Sequence[type[torch.nn.Module]] = False,
                   trainable: Literal["host", "device"] = "host",
                   sources: Mapping[str, LazyTensor] | None = None) -> HostNeeds:
        """What :meth:`from_module` with these arguments would need in host memory, without
        capturing anything: ``floor`` (the smallest ``max_host_bytes`` it accepts) and
        ``everything`` (host bytes with every unit in an arena). For splitting one host budget
        between several models before capturing them.

        Raises:
            The errors of :meth:`from_module` for bad blocks, layers or tensors; nothing changes.
        """
        groups, chosen, on_device = units_of(model, blocks, layers, trainable)
        return HostStorage.needs(model, groups, chosen, skip=on_device, sources=sources)

    @property
    def active(self) -> bool:
        """Whether an activation is in progress."""
        return self._active is not None

    @property
    def device(self) -> torch.device | None:
        """The device of the current activation (None when inactive)."""
        return self._active.device if self._active else None

    @property
    def plan(self) -> ResidencyPlan | None:
        """The current activation's residency (None when inactive or a CPU pass-through)."""
        return self._active.plan if self._active else None

    @property
    def streamers(self) -> dict[str, BlockStreamer]:
        """The current activation's streamers, per group that streams."""
        return dict(self._active.streamers) if self._active else {}

    @property
    def layer_streamer(self) -> LayerStreamer | None:
        """The current activation's layer streamer (layer mode with streamed layers)."""
        return self._active.layer_streamer if self._active else None

    @property
    def adapters(self) -> ActivationAdapters | None:
        """The current activation's adapters (``report``, ``mode``); None without any."""
        return self._active.adapters if self._active else None

    def plan_for(self, stream: StreamConfig | None) -> ResidencyPlan:
        """The residency ``stream`` asks for on this model: what an activation keeps on the
        device, chosen once here from ``stream``'s budget (less the bytes of the parameters
        kept on the device with ``trainable="device"``, which take that memory for the whole
        activation). Pass it to :meth:`activate` / :meth:`use` as ``plan=``.

        Args:
            stream: the streaming asked for (None: everything resident).

        Returns:
            The plan of ``stream``'s policy, checked against this model's storage.

        With a host ceiling the plan has a host tier too: which units keep host arenas
        (``pinned``) and the staging ring (``staging``), applied when it is activated.

        Raises:
            BudgetTooSmallError: ``stream.vram_budget`` cannot hold the trainable parameters
                kept on the device, or is below the model's floor (the rest of the model plus
                one slot of each group's largest block, plus ``stream.activation_bytes``); the
                message names the floor in bytes.
            OffloadError: a custom policy's plan does not fit the model or the budget.
        """
        if stream is None or stream.vram_budget is None or not self.on_device:
            return plan_residency(self.storage, stream)
        kept = sum(p.numel() * p.element_size() for p in self.on_device)
        if kept >= stream.vram_budget:
            raise BudgetTooSmallError(
                f"vram_budget={stream.vram_budget} bytes cannot hold the {kept} bytes of "
                "trainable parameters kept on the device (trainable='device'), let alone the "
                "model; raise the budget")
        return plan_residency(self.storage,
                              dataclasses.replace(stream, vram_budget=stream.vram_budget - kept))

    def activate(self, device: str | torch.device = "cuda",
                 stream: StreamConfig | None = None, *, plan: ResidencyPlan | None = None,
                 loras: AdapterList = (),
                 mode: Mode = "merge", quality: Quality | None = None,
                 mapping: KeyMapping | None = None,
                 auto_threshold: float = DEFAULT_THRESHOLD,
                 lora_mode: Mode | None = None, wait: bool = True) -> torch.nn.Module:
        """Place the model on ``device``, with adapters applied if given; returns the model.

        Args:
            device: where to compute. ``"cpu"`` is a pass-through.
            stream: stream blocks as configured; None puts the whole model on the device.
            plan: the residency chosen already (by :meth:`plan_for`, where the budget was
                given): used as it is, after a check that it fits this model. ``stream`` then
                only gives ``compile``; its ``prefetch`` is the plan's.
            loras: ``[(lora, strength), ...]`` applied for this activation only; strengths of
                exactly 0 are dropped before anything is built.
            mode: ``"merge"``: folded into each weight right after its copy lands (float32
                sum, one rounding: the weights :func:`~shuttle.merge_lora` would give; a block
                streamed again is merged again from the pristine host copy). ``"dynamic"``:
                added at forward time by hooks (as :func:`~shuttle.attach_lora`), weights
                untouched. ``"auto"``: per parameter, merged where a merge in its dtype
                rounds away at most ``auto_threshold`` of the update, dynamic elsewhere (as
                ``apply_lora(mode="auto")``; ``adapters.decisions`` tells which). Either way the
                patch tensors are read onto ``device`` once.
            quality: the dynamic tier (``"exact"``, ``"lossless"``, ``"fused"``, ``"auto"``).
            mapping: adapter module key -> model module path, as for ``merge_lora``.
            auto_threshold: see ``mode="auto"``.
            lora_mode: the former name of ``mode`` (a ``FutureWarning``).
            wait: False: the current stream is not made to wait for the resident weights'
                copies, so that work queued on it next (another model's call) runs while they
                land; call :meth:`ready` before the model's first forward.

        Raises:
            AlreadyActiveError: an activation is in progress (call ``deactivate`` first).
            BudgetTooSmallError: ``stream.vram_budget`` is too small; nothing was changed.
            InvalidOptionError: an unknown ``mode``.
            OffloadError: an unknown ``quality``; a ``plan`` with a ``stream`` that
                asks for a residency too (``vram_budget``, ``resident`` or ``policy``: the
                plan was chosen from one already), or a plan that does not fit this model.
            InvalidStrengthError: ``auto_threshold`` is not a finite number >= 0.
            StreamModeError: ``stream.compile`` on an offloader without block lists.
            Everything :func:`~shuttle.merge_lora` raises for bad adapters (and
            ``UnsupportedLayerError`` for a patch a layer cannot take dynamically), before any
            device memory is taken for weights; the offloader stays inactive.
            Any failure while placing the model is re-raised after a full rollback (hooks
            removed, device buffers dropped, tensors back on the host); the offloader stays
            usable.
        """
        if self._active is not None:
            raise AlreadyActiveError(
                f"the offloader is already active on {self._active.device}; call deactivate() "
                "(or leave the use() block) before activating again"
            )
        mode = former_mode(mode, lora_mode)
        check_mode(mode, "ModelOffloader.activate")
        check_quality(quality)
        auto_threshold = check_threshold(auto_threshold)
        if stream is not None and stream.compile is not False and not self.blocks:
            raise StreamModeError(
                "StreamConfig(compile=...) compiles block forwards, and this offloader has no "
                "block lists: give from_module(..., blocks=[...]), or torch.compile the layers' "
                "callers yourself with compile left False (layer-mode hooks must stay eager)"
            )
        pairs = normalize_loras(loras)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        through = device.type == "cpu" and os.environ.get(CPU_COPY_ENV) != "1"
        if plan is not None:
            check_given_plan(plan, stream, self.storage)
        if through:
            plan = None
        elif plan is None:
            plan = self.plan_for(stream)
        adapters = ActivationAdapters(self.model, self.storage, pairs, mode, device,
                                      quality, mapping, auto_threshold) if pairs else None
        active = Activation(device, plan, adapters)
        try:
            if plan is not None:  # the host tier first: arenas given and taken, staging sized
                self.storage.settle(plan.pinned, plan.staging)
            if not through:
                move(self.on_device, device)
            if through:
                active.pass_through(self.storage)
            else:
                active.place(self.storage, self.blocks, self.layers, wait)
            if adapters is not None and adapters.dynamic:
                adapters.attach()  # after the stream hooks: they bind weights first
            if not through and stream is not None and stream.compile is not False:
                # Last, so that the compiled forward is the innermost hook of every block.
                backend = "inductor" if stream.compile is True else stream.compile
                active.compiler = BlockCompiler(backend)
                active.compiler.attach([b for blocks in self.blocks.values() for b in blocks])
        except BaseException:
            active.teardown(self.storage, self.on_device)
            raise
        self._active = active
        return self.model

    def ready(self) -> None:
        """Make the current stream wait for the copies an ``activate(wait=False)`` left
        unwaited (nothing when there are none).
        """
        if self._active is not None:
            self._active.ready()

    def deactivate(self) -> None:
        """End the activation: hooks removed, tensors back on the host, device slots dropped.

        The device memory returns to PyTorch's caching allocator (no ``empty_cache``). Does
        nothing when inactive.
        """
        if self._active is not None:
            active, self._active = self._active, None
            active.teardown(self.storage, self.on_device)

    @contextlib.contextmanager
    def use(self, device: str | torch.device = "cuda", stream: StreamConfig | None = None, *,
            plan: ResidencyPlan | None = None, loras: AdapterList = (), mode: Mode = "merge",
            quality: Quality | None = None, mapping: KeyMapping | None = None,
            auto_threshold: float = DEFAULT_THRESHOLD, lora_mode: Mode | None = None,
            wait: bool = True) -> Iterator[torch.nn.Module]:
        """``activate`` for the ``with`` block, ``deactivate`` after it (also on error)."""
        model = self.activate(device, stream, plan=plan, loras=loras,
                              mode=former_mode(mode, lora_mode), quality=quality,
                              mapping=mapping, auto_threshold=auto_threshold, wait=wait)
        try:
            yield model
        finally:
            self.deactivate()

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Run an optimizer step on the host copies of the trainable parameters.

        ::

            loss.backward()
            with off.optimizer_step():
                opt.step()
                opt.zero_grad()

        Inside the block every parameter with ``requires_grad`` points at its host storage and
        its gradient is a host copy, so the optimizer (and its state) works on the weights of
        record; after it, device copies of resident units holding trainable parameters are
        refreshed and streamed blocks or layers are loaded again from the updated host copies.
        Copying the gradients to the host synchronizes once per step. When inactive (or on the
        CPU pass-through) the parameters already are the host copies: nothing moves.

        Raises:
            StreamModeError: a trainable parameter lies in a unit that a merge-mode adapter
                folds into (train beside adapters with ``mode="dynamic"``), or in a unit
                kept coded (``compress="lossless"``).
            PendingGradientError: gradients were left on trainable parameters (call
                ``optimizer.zero_grad()`` inside the block); the activation stays usable.
        """
        coded = [u.name for u in self.storage.units if u.code is not None
                 and any(b.is_param and b.module._parameters[b.name].requires_grad
                         for b in u.bindings)]
        if coded:
            raise StreamModeError(
                f"optimizer_step: trainable parameters lie in units kept coded ({coded[:3]}; "
                "compress='lossless'), which have no host copy to update; capture with "
                "trainable='device' (the trainable parameters stay on the device) or without "
                "compress")
        active = self._active
        if active is None or active.plan is None:
            yield
            return
        adapters = active.adapters
        merged = frozenset(u.name for u in self.storage.units if adapters is not None
                           and adapters.touches(u))
        streamers: list[Streamer] = list(active.streamers.values())
        if active.layer_streamer is not None:
            streamers.append(active.layer_streamer)
        with host_step(self.storage, active.placed, streamers, merged):
            yield
