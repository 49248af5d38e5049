"""``OffloadHandle``: several modules under one :class:`~shuttle.ModelCache`, activated on call.

Each module (a pipeline component, or a whole model) is captured into host storage by the
cache (one host byte budget for all of them and their adapters) and leased for the handle's
lifetime: its bytes live in the caller's object, so evicting it would free nothing. A shuttle
hook on its ``forward`` (and wrappers on entry methods such as a VAE's ``decode``) activates
it on the device when it is called; it stays active across calls (a denoiser called once per
step keeps its resident blocks) until another module needs the device room, the adapters
change, or :meth:`OffloadHandle.deactivate`/:meth:`OffloadHandle.remove` is called.

With a ``vram_budget`` the budget bounds weights and activations together: each module's
weights are planned within the budget less the activations measured on its calls
(:mod:`shuttle.integrations.activations`). A module's first call runs at its floor (every block
streamed, none resident) with the other modules off the device; the call is measured and the
module planned again through ``plan_for``, and again whenever a later call outgrows its
reserve. A module whose activations do not fit beside its floor gets a shrinker's help when it
has one (tiled VAE decoding; asked before a first call, whose activations it predicts, as well
as after any call that went over), else :class:`~shuttle.errors.BudgetTooSmallError` names its
floor. What the caller holds on the device as a call begins (a pipeline's latents and prompt
embeddings) counts with the call's activations: the budget bounds everything allocated since
the handle was made.
While a module runs, the others stay on the device only as far as their weights fit beside its
weights and reserve, and the modules called after it last time are activated beside it as far as
theirs fit too: their copies run under its compute (:mod:`~shuttle.integrations.call_order`).

**Host ceiling.** The cache's byte budget (``max_host_bytes`` of the integrations' ``offload``)
bounds everything shuttle holds in host memory for the handle: arenas, staging buffers and
adapters. Modules captured straight from their files (``sources=``) need not fit in it: when
everything does not fit, each gets a share of the budget (at least its floor, then more for the
modules read most often in a call first, up to what they need to stay whole: ``hot`` ones such
as a pipeline's denoiser, then those with streamed blocks; see
:func:`~shuttle.integrations.budgets.read_order`) as its ``max_host_bytes``, and what its share
does not hold is read from its files at each load (:mod:`shuttle.offload.disk_reader`). Each
share is charged to the cache (its floor with the module, the rest as a reservation beside it),
and :meth:`OffloadHandle.set_loras` lowers the shares, down to the floors, the least often read
modules first, when adapters need the room.

Uses are single-threaded: one call into the offloaded modules at a time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shuttle.apply.merge import MergeReport
from shuttle.apply.plan import AdapterList, Mode, check_mode, normalize_loras
from shuttle.byte_count import ByteCount
from shuttle.cache import LoRASpec, ModelCache, ModelSpec, ObjectSpec
from shuttle.cache.specs import module_bytes
from shuttle.errors import BudgetTooSmallError
from shuttle.formats import LoRA
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.hooks import add_hook
from shuttle.integrations.activations import ActivationMeter, CallShrinker, DeviceMeter, Reading
from shuttle.integrations.budgets import SourcedSpec, check_device, host_shares, read_order
from shuttle.integrations.call_order import CallOrder
from shuttle.integrations.component import ActivateHook, Active, Component, check_free, restore
from shuttle.integrations.routing import Routed, route_loras
from shuttle.offload import ModelOffloader, ResidencyPlan, RingOnlyResidency, StreamConfig
from shuttle.offload.coded import Compression
from shuttle.offload.host_storage import HostBacking
from shuttle.offload.residency import floor_bytes
from shuttle.weights.upcast import upcast_on_use

__all__ = ["OffloadHandle"]

logger = logging.getLogger(__name__)


class OffloadHandle:
    """Modules offloaded through one cache; built by the integrations' ``offload`` functions.

    Args:
        modules: name -> module (on any device; captured into host storage here).
        blocks: name -> block-list paths that stream (absent or empty: moved whole).
        cache: the cache that holds them (and their adapters).
        device: where they compute.
        prefetch: blocks loaded ahead while streaming.
        vram_budget: device bytes for everything active at once, weights and the running
            module's activations (measured, see the module docs). None: one module active at a
            time, streamed ones with ``prefetch`` and no resident blocks, nothing measured.
        host: ``"pinned"`` or ``"adopt"`` (see :class:`~shuttle.ModelSpec`).
        methods: name -> entry methods besides ``forward`` that activate the module.
        attrs: instance attributes set on every module while offloaded (removed at the end).
        classes: name -> the class a module takes while offloaded: a subclass of its own
            class that adds no state (e.g. one whose ``device`` reports the compute device);
            its own class comes back at :meth:`remove`.
        key_prefix: prefix of the cache keys (``f"{key_prefix}.{name}"``).
        shrink: name -> a :class:`~shuttle.integrations.activations.CallShrinker`, enabled
            when that module's activations do not fit the budget beside its weights.
        meter: measures each call's activations (default:
            :class:`~shuttle.integrations.activations.DeviceMeter`, CUDA's allocator
            statistics; tests pass one that reports given numbers).
        sources: name -> (qualified tensor name -> its tensor in a safetensors file): that
            module may be built on the ``meta`` device and is filled from its files at capture
            (see :class:`~shuttle.offload.HostStorage`), and kept on disk beyond its share of
            the cache's budget (see the module docs); :meth:`remove` leaves it on ``meta``.
        compress: ``"lossless"``: host copies kept coded (see :class:`~shuttle.ModelSpec`).
        hot: names of the modules called most often (a pipeline's denoisers, once a step):
            first in line for host memory when the modules do not all fit in it.
        upcast: name -> the dtype a module holding float8 weights computes in: each of its
            layers runs with them cast to that dtype (:func:`~shuttle.upcast_on_use`; the
            float8 bytes are what is held, read and streamed), undone by :meth:`remove`.

    Attributes:
        device: the compute device.
        unmatched: adapter keys of the current :meth:`set_loras` that reach no parameter.

    Raises:
        OffloadError: a bad ``prefetch``/``vram_budget``, a module offloaded already, or an
            attribute in ``attrs`` or a
            method in ``methods`` is already set on an instance (another offloading library).
        BudgetTooSmallError: ``vram_budget`` cannot hold a module moved whole, or a streamed
            module's non-block weights plus one slot of each block list's largest block (a
            call whose measured activations do not fit beside a module's floor raises it too,
            after the call, naming the floor: weights plus activations); or the cache's free
            bytes cannot hold the host floors of the modules (named, with the total).
        ResourceTooLargeError: the modules do not fit in the cache's budget.
        Whatever ``ModelOffloader.from_module`` raises (``BlockPathError``, ...).
        On any error every module is as it was before the call.
    """

    def __init__(self, modules: Mapping[str, torch.nn.Module],
                 blocks: Mapping[str, Sequence[str]], *, cache: ModelCache,
                 device: str | torch.device, prefetch: int = 2,
                 vram_budget: ByteCount | None = None,
                 host: HostBacking = "pinned", methods: Mapping[str, Sequence[str]] | None = None,
                 attrs: Mapping[str, Any] | None = None,
                 classes: Mapping[str, type] | None = None, key_prefix: str = "offloaded",
                 shrink: Mapping[str, CallShrinker] | None = None,
                 meter: ActivationMeter | None = None,
                 sources: Mapping[str, Mapping[str, LazyTensor]] | None = None,
                 compress: Compression | None = None, hot: Sequence[str] = (),
                 upcast: Mapping[str, torch.dtype] | None = None):
        methods, attrs, classes = methods or {}, attrs or {}, classes or {}
        sources = sources or {}
        self.device = check_device(device)  # at offload time, not at the first call
        # what the process held on the device before (not this handle's to count: _outside)
        self._before = (torch.cuda.memory_allocated(self.device)
                        if self.device.type == "cuda" else 0)
        # validates both; the budget as whole bytes
        vram_budget = StreamConfig(prefetch=prefetch, vram_budget=vram_budget).vram_budget
        self.unmatched: dict[str, str] = {}
        self._cache = cache
        self._vram_budget = vram_budget
        self._prefetch = prefetch
        self._meter: ActivationMeter = meter if meter is not None else DeviceMeter()
        self._components: dict[str, Component] = {}
        self._offloaders: dict[str, ModelOffloader] = {}
        self._leases = contextlib.ExitStack()
        self._active: dict[str, Active] = {}  # least recently used first
        self._running: dict[str, int] = {}  # calls in progress: never deactivated
        self._order = CallOrder()
        self._loras: dict[str, list[tuple[LoRASpec, float]]] = {}
        self._mode: Mode = "merge"
        self._routed: Routed = {}  # id(lora) -> (lora, component -> its spec)
        check_free(modules, methods, attrs, classes)
        self._hot = tuple(hot)
        shares = host_shares(modules, blocks, host, sources, cache.available_bytes, self._hot)
        try:
            for name, module in modules.items():
                self._capture(name, module, tuple(blocks.get(name, ())), host, key_prefix,
                              prefetch, sources.get(name), shares.get(name), compress)
                self._components[name].shrink = (shrink or {}).get(name)
            for name, c in self._components.items():
                self._install(c, methods.get(name, ()), attrs, classes.get(name))
            for name, dtype in (upcast or {}).items():
                self._components[name].upcasting = upcast_on_use(modules[name], dtype)
        except BaseException:
            self.remove()
            raise

    @property
    def cache(self) -> ModelCache:
        """The cache that holds the modules and adapters (``used_bytes``: host bytes held)."""
        return self._cache

    @property
    def offloaders(self) -> dict[str, ModelOffloader]:
        """Each module's offloader by name (``plan``, ``adapters.report`` while active)."""
        return dict(self._offloaders)

    @property
    def reserves(self) -> dict[str, int | None]:
        """Device bytes kept for each module's activations (its largest measured peak plus a
        margin, capped by what its floor leaves); None until a call has measured it, and for
        every module when the handle has no ``vram_budget``.
        """
        return {n: c.reserve for n, c in self._components.items()}

    @property
    def reports(self) -> dict[str, MergeReport]:
        """The adapter report of each module active with adapters now, by name."""
        return {n: off.adapters.report for n, off in self._offloaders.items()
                if off.adapters is not None}

    def set_loras(self, loras: AdapterList, mode: Mode = "merge") -> dict[str, str]:
        """Apply ``loras`` from the next call on (``[]`` removes every adapter).

        Each adapter is split over the modules it touches (see
        :func:`~shuttle.integrations.routing.route_lora`) and applied by each module's
        offloader while it is active: merged into the weights as they land (``"merge"``, the
        weights :func:`~shuttle.merge_lora` gives) or at forward time (``"dynamic"``). Modules
        active with other adapters are deactivated now; the host weights never change.

        Args:
            loras: ``[(lora or source, strength), ...]``; strengths of exactly 0 are dropped.
            mode: ``"merge"`` or ``"dynamic"``.

        Returns:
            Adapter keys that reach no parameter of any module -> why (also in
            :attr:`unmatched`, and logged as a warning).

        Raises:
            InvalidStrengthError: a strength is not a finite number.
            InvalidOptionError: an unknown ``mode``.
            DuplicateTargetError: one key lands in two modules.
            Whatever ``shuttle.load_lora`` raises for a source. Nothing changes on error.
        """
        check_mode(mode, "OffloadHandle.set_loras")
        pairs = normalize_loras(loras)
        specs, wanted, unmatched = route_loras(
            pairs, {n: c.module for n, c in self._components.items()}, self._routed,
            {n: c.spec.key for n, c in self._components.items()})
        self._mode, self._loras = mode, wanted
        for name in list(self._active):
            if self._active[name].config != self._config(name):
                self._deactivate(name, "its adapters changed")
        self._drop_specs(specs)
        self._make_host_room(sum(spec.source.nbytes for _, subs in specs.values()
                                 for spec in subs.values() if spec.key not in self._cache
                                 and isinstance(spec.source, LoRA)))
        self.unmatched = unmatched
        if unmatched:
            logger.warning("%d adapter keys reach no parameter: %s", len(unmatched),
                           dict(list(unmatched.items())[:4]))
        return dict(unmatched)

    def deactivate(self) -> None:
        """Take every module off the device (its weights stay in host storage)."""
        for name in list(self._active):
            self._deactivate(name, "deactivate() was called")

    def remove(self) -> None:
        """Undo the offload: every module as it was, on its original devices, unhooked.

        Adapters and host copies are dropped from the cache. Calling it twice does nothing.
        """
        self.deactivate()
        for c in self._components.values():
            c.uninstall()
        self._leases.close()
        self._drop_specs({})
        for name, off in self._offloaders.items():
            c = self._components[name]
            restore(off.storage, c.devices)
            self._cache.evict(c.spec.key)
            if c.host_lease is not None:
                self._cache.evict(f"{c.spec.key}.host-reserve")
        self._offloaders.clear()
        self._components.clear()

    # -- internals -------------------------------------------------------------------------
    def _capture(self, name: str, module: torch.nn.Module, paths: tuple[str, ...],
                 host: HostBacking, key_prefix: str, prefetch: int,
                 sources: Mapping[str, LazyTensor] | None = None,
                 share: tuple[int, int] | None = None,
                 compress: Compression | None = None) -> None:
        devices = {(id(m), n, p): t.device for m in module.modules()
                   for p, table in ((True, m._parameters), (False, m._buffers))
                   for n, t in table.items() if t is not None}
        key = f"{key_prefix}.{name}"
        if sources is None:
            spec: Any = ModelSpec(key, factory=lambda: module,
                                  estimated_bytes=module_bytes(module), blocks=paths, host=host,
                                  compress=compress)
        else:
            spec = SourcedSpec(key, module, paths, host, sources,
                                *(share if share is not None else (None, None)), compress)
        c = Component(name, module, spec, devices)
        # Leased until remove(): nothing could rebuild the module after an eviction.
        off = self._leases.enter_context(self._cache.lease(spec))
        self._components[name], self._offloaders[name] = c, off
        if share is not None:  # the rest of its share, for the arenas its plans may add
            c.share, c.host_floor = share
            c.captured = self._cache.info(key).nbytes
            self._reserve(c)
        budget = self._vram_budget
        c.paths = paths
        self._replan(c)  # raises below the weights' floor
        c.floor = floor_bytes(off.storage) if paths else c.need
        if not paths and budget is not None and c.need > budget:
            raise BudgetTooSmallError(
                f"vram_budget={budget} bytes cannot hold {name!r} moved whole: give at least "
                f"{c.need} bytes (its weights; its activations are measured on its first "
                f"call), or stream {name!r} by giving its block lists in blocks=")
        logger.info("%s: %s%s", name, f"streams {list(paths)} ({c.need} device bytes)" if paths
                    else f"moves whole ({c.need} device bytes)",
                    "" if c.share is None else f", {c.share} host bytes at most (the rest read "
                    "from its files)")

    def _replan(self, c: Component) -> None:
        """Choose ``c``'s residency (device and host tiers) for what is known now: before its
        activations are measured, its floor (nothing resident, one slot per list: prefetch 0
        under a budget); after, the budget less its reserve; without block lists, whole.

        Raises:
            BudgetTooSmallError: the budget (or its host share) is below the floor.
        """
        off, budget = self._offloaders[c.name], self._vram_budget
        if not c.paths:
            stream = None
        elif c.reserve is None:
            stream = StreamConfig(prefetch=self._prefetch if budget is None else 0,
                                  vram_budget=budget, policy=RingOnlyResidency())
        else:
            stream = StreamConfig(prefetch=self._prefetch, vram_budget=budget,
                                  activation_bytes=c.reserve)
        c.plan = off.plan_for(stream)

    def _reserve(self, c: Component) -> None:
        """Charge the cache for the part of ``c``'s share beyond what its entry is charged."""
        assert c.share is not None
        key = f"{c.spec.key}.host-reserve"
        if c.host_lease is not None:
            c.host_lease.close()
            self._cache.evict(key)
        c.host_lease = contextlib.ExitStack()
        c.host_lease.enter_context(self._cache.lease(ObjectSpec(
            key, factory=lambda: None, bytes=max(0, c.share - c.captured))))
        self._leases.callback(c.host_lease.close)

    def _make_host_room(self, need: int) -> None:
        """Lower the host shares of modules with a disk tier until ``need`` more bytes fit in
        the cache (adapters about to be loaded): the least often read modules first (the
        reverse of :func:`~shuttle.integrations.budgets.read_order`), each down to its floor;
        what no longer fits is read from its files. A module that gives room is deactivated and
        its plan made again.
        """
        short = need - self._cache.available_bytes
        paths = {n: c.paths for n, c in self._components.items()}
        for name in reversed(read_order(list(self._components), paths, self._hot)):
            c = self._components[name]
            if short <= 0:
                break
            room = 0 if c.share is None else c.share - max(c.host_floor, c.captured)
            if room <= 0 or self._running.get(name):
                continue
            if name in self._active:
                self._deactivate(name, "make host room for adapters")
            take = min(room, short)
            off = self._offloaders[name]
            c.share -= take
            off.storage.max_host_bytes = c.share
            self._replan(c)
            off.storage.settle(c.plan.pinned, c.plan.staging)  # within the new share now
            self._reserve(c)
            short -= take
            logger.info("%s: host share lowered by %d bytes to %d for adapters", name, take,
                        c.share)

    def _install(self, c: Component, methods: Sequence[str], attrs: Mapping[str, Any],
                 cls: type | None) -> None:
        if cls is not None:
            c.own_class, c.module.__class__ = type(c.module), cls
        c.hook = ActivateHook(self._call, c.name)
        add_hook(c.module, c.hook)
        for method in methods:
            original = getattr(c.module, method)
            c.module.__dict__[method] = functools.wraps(original)(
                functools.partial(self._call, c.name, original))
            c.wrapped.append(method)
        for attr, value in attrs.items():
            c.module.__dict__[attr] = value
            c.attrs.append(attr)

    def _call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        c = self._components[name]
        outside = self._outside()  # the same before and after _enter: it counts active weights
        if self._vram_budget is not None and c.reserve is None:
            c.foresee(self._vram_budget - outside, self.device,
                      getattr(fn, "__name__", "forward"), args, kwargs)
        self._enter(name)
        # a turn's first call from outside the modules (not a step loop's next)
        if not any(self._running.values()) and self._order.saw(name):
            self._look_ahead(c)
        self._running[name] = self._running.get(name, 0) + 1
        try:
            if self._vram_budget is None:  # nothing to plan against: nothing measured
                return fn(*args, **kwargs)
            with self._meter.measure(name, self.device, c.reserve is None) as reading:
                out = fn(*args, **kwargs)
        finally:
            self._running[name] -= 1
        if outside:  # the caller's tensors count against the budget as the call's own do
            reading = Reading(reading.peak + outside, reading.margin)
        self._learn(c, reading)
        return out

    def _outside(self) -> int:
        """Device bytes allocated since the handle was made beside the active modules' weights
        as a call begins: the caller's tensors (a pipeline's latents and prompt embeddings),
        which the budget must hold as well. 0 off CUDA, where nothing is measured.
        """
        if self.device.type != "cuda":
            return 0
        held = sum(a.need for a in self._active.values())
        return max(0, torch.cuda.memory_allocated(self.device) - self._before - held)

    def _learn(self, c: Component, reading: Reading) -> None:
        """Plan ``c`` again when ``reading`` is its first or outgrows its reserve
        (:meth:`Component.learn`), and take it off the device if its plan changed.
        """
        budget = self._vram_budget
        assert budget is not None
        if not c.learn(reading, budget):
            return
        self._replan(c)
        active = self._active.get(c.name)
        logger.info("%s: %d bytes of activations measured, %d reserved; %d weight bytes "
                    "planned", c.name, reading.peak, c.reserve, c.need)
        if active is not None and active.plan != c.plan and not self._running.get(c.name):
            self._deactivate(c.name, "planned again with its measured activations")

    def _config(self, name: str) -> tuple:
        pairs = tuple((spec.key, w) for spec, w in self._loras.get(name, ()))
        return pairs, self._mode if pairs else None

    def _enter(self, name: str) -> None:
        active = self._active.get(name)
        c = self._components[name]
        if active is not None and active.plan != c.plan and not active.ahead:
            self._deactivate(name, "planned again with its measured activations")
            active = None
        self._make_room(c)  # on every call: others may have come since its activation
        if active is not None:
            self._active[name] = self._active.pop(name)  # most recently used now
            self._offloaders[name].ready()  # copies of an activation ahead of its call
            active.ahead = False  # its plan stands for this call only
            return
        self._activate(c, c.plan)

    def _activate(self, c: Component, plan: ResidencyPlan | None, wait: bool = True) -> None:
        stack = contextlib.ExitStack()
        with stack:
            stack.enter_context(self._cache.use(c.spec, self.device,
                                                loras=self._loras.get(c.name, []), plan=plan,
                                                mode=self._mode, wait=wait))
            self._active[c.name] = Active(stack.pop_all(), self._config(c.name), plan,
                                          plan.device_bytes if plan else 0, not wait)

    def _look_ahead(self, c: Component) -> None:
        """Activate what :meth:`CallOrder.ahead` names in the room left beside ``c``'s call."""
        if self._vram_budget is None or c.reserve is None:
            return
        room = (self._vram_budget - c.reserve - self._outside()
                - sum(a.need for a in self._active.values()))
        try:
            for s, plan in self._order.ahead(c.name, room, self._components, self._offloaders,
                                             self._active, self._prefetch):
                self._activate(s, plan, wait=False)  # rolled back whole if it fails
                logger.info("%s: activated ahead under %s's call (%d of its %d device bytes)",
                            s.name, c.name, plan.device_bytes, s.need)
        except Exception:  # a guess at the next calls never fails this one (a device OOM)
            logger.warning("activating ahead under %s's call failed: the modules after it wait "
                           "for their own calls", c.name, exc_info=True)

    def _make_room(self, c: Component) -> None:
        budget = self._vram_budget
        # Its weights and its reserve beside the others' weights (their activations are gone
        # once their calls returned); a module not measured yet runs alone.
        want = c.need + (c.reserve if c.reserve is not None else budget or 0)
        used = sum(a.need for n, a in self._active.items() if n != c.name)
        for other in list(self._active):
            if budget is not None and used + want <= budget:
                break
            if other == c.name or self._running.get(other):
                continue  # itself, or a call still on the stack (it called this module)
            used -= self._active[other].need
            self._deactivate(other, f"make room for {c.name!r}" if budget is not None
                             else f"{c.name!r} is called (vram_budget=None: one at a time)")

    def _deactivate(self, name: str, why: str) -> None:
        logger.info("deactivating %s (%d device bytes): %s", name, self._active[name].need, why)
        self._active.pop(name).stack.close()

    def _drop_specs(self, keep: Routed) -> None:
        """Evict the adapters of the previous :meth:`set_loras` that ``keep`` lacks."""
        kept = {spec.key for _, specs in keep.values() for spec in specs.values()}
        for _, specs in self._routed.values():
            for spec in specs.values():
                if spec.key not in kept and spec.key in self._cache:
                    self._cache.evict(spec.key)
        self._routed = keep
