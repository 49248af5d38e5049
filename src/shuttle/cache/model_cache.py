"""``ModelCache``: a :class:`ResourceCache` that also activates the models it holds.

``use`` leases the adapters, then the model (building whatever is missing, under the shared
budget), activates the model's offloader on the device with the adapters, yields the model,
and unwinds in reverse order: deactivate, release the model's lease, release the adapters'.
A failure at any step unwinds the steps already taken and re-raises.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from shuttle.apply.auto import DEFAULT_THRESHOLD
from shuttle.apply.dynamic_layer import Quality
from shuttle.apply.plan import Mode, check_mode
from shuttle.apply.strength import check_strength
from shuttle.byte_count import ByteCount
from shuttle.cache.policy import EvictionPolicy
from shuttle.cache.resource_cache import ResourceCache
from shuttle.cache.specs import LoRASpec, ModelSpec, Spec
from shuttle.errors import (
    CacheError,
    ModelInUseError,
)
from shuttle.offload import ModelOffloader, ResidencyPlan, StreamConfig
from shuttle.offload.adapters import check_quality, former_mode
from shuttle.targets import KeyMapping

__all__ = ["ModelCache"]

logger = logging.getLogger(__name__)


class ModelCache(ResourceCache):
    """Models and adapters under one byte budget, activated on a device by :meth:`use`.

    Every ``ResourceCache`` method works here too. A model entry is one offloader holding one
    model: its uses are sequential (a second overlapping ``use`` raises ``ModelInUseError``).
    For concurrent replicas, register separately built models under distinct keys.

    Args:
        max_bytes: the host byte budget shared by every model and adapter (bytes, or
            ``"16GiB"``: see :func:`~shuttle.byte_count.byte_count`).
        policy: chooses victims among unleased entries (default LRU).
    """

    def __init__(self, max_bytes: ByteCount, policy: EvictionPolicy | None = None):
        super().__init__(max_bytes, policy)
        self._in_use: set[Hashable] = set()  # model keys inside a use(); guarded by _cond

    def in_use(self, key: Hashable) -> bool:
        """Whether a ``use`` of the model under ``key`` is in progress."""
        with self._cond:
            return key in self._in_use

    @contextlib.contextmanager
    def use(self, model: ModelSpec | Spec | Hashable, device: str | torch.device = "cuda",
            loras: Sequence[tuple[LoRASpec | Spec | Hashable, float]] = (),
            mode: Mode = "merge", stream: StreamConfig | None = None, *,
            plan: ResidencyPlan | None = None, quality: Quality | None = None,
            mapping: KeyMapping | None = None, auto_threshold: float = DEFAULT_THRESHOLD,
            lora_mode: Mode | None = None, wait: bool = True) -> Iterator[torch.nn.Module]:
        """Lease, build if missing, and activate a model for the ``with`` block.

        Args:
            model: the model's spec (built and admitted on first use) or the key of a
                registered one. Its value must be a ``ModelOffloader``.
            device: where to compute.
            loras: ``(adapter spec or key, strength)`` pairs, applied while active; those of
                strength 0 are skipped (not leased, not built).
            mode, quality, mapping, auto_threshold: how the adapters are applied, as for
                :meth:`ModelOffloader.activate <shuttle.offload.ModelOffloader.activate>` (and
                :func:`~shuttle.apply_lora`).
            stream: block streaming for this activation (None: the whole model on the device).
            plan: the residency chosen already by the model's
                :meth:`~shuttle.offload.ModelOffloader.plan_for` (where the budget was given);
                ``stream`` then gives only ``compile``.
            lora_mode: the former name of ``mode`` (a ``FutureWarning``).
            wait: False: activated without making the current stream wait for its copies
                (:meth:`ModelOffloader.activate <shuttle.offload.ModelOffloader.activate>`);
                its ``ready()`` must come before the model runs.

        Yields:
            The model, active on ``device``.

        Raises:
            ModelInUseError: another ``use`` of this model is in progress.
            InvalidOptionError: an unknown ``mode``, before anything is built.
            InvalidStrengthError: a strength is not a finite number.
            CacheError: the model's value is not a ``ModelOffloader``.
            Any error of leasing (``ResourceTooLargeError``, ...), building or activating,
            after every lease taken so far was released.
        """
        pairs = _check_loras(loras)
        mode = former_mode(mode, lora_mode)
        check_mode(mode, "ModelCache.use")  # before building anything
        check_quality(quality)
        key = model.key if hasattr(model, "build") else model  # type: ignore[union-attr]
        with self._cond:
            if key in self._in_use:
                raise ModelInUseError(f"model {key!r} is in use by another use() (this thread "
                                      "or another); uses of one model are sequential")
            self._in_use.add(key)
        try:
            with contextlib.ExitStack() as stack:
                adapters = [(stack.enter_context(self.lease(spec)), w) for spec, w in pairs]
                off = stack.enter_context(self.lease(model))
                if not isinstance(off, ModelOffloader):
                    raise CacheError(f"cache entry {key!r} holds a {type(off).__name__}, not a "
                                     "ModelOffloader; use() needs a ModelSpec (or a spec "
                                     "building an offloader)")
                active = stack.enter_context(off.use(
                    device, stream, plan=plan, loras=adapters, mode=mode, quality=quality,
                    mapping=mapping, auto_threshold=auto_threshold, wait=wait))
                _log_residency(key, off)
                yield active
        finally:
            with self._cond:
                self._in_use.discard(key)


def _check_loras(loras: Sequence[tuple[Any, float]]) -> list[tuple[Any, float]]:
    pairs = []
    for i, pair in enumerate(loras):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise CacheError(f"loras[{i}]={pair!r}: expected a (LoRASpec or key, strength) "
                             "pair")
        spec, w = pair
        w = check_strength(w, f"loras[{i}] strength")
        if w != 0:  # as the offloader does: an adapter at strength 0 is not even built
            pairs.append((spec, w))
    return pairs


def _log_residency(key: Hashable, off: ModelOffloader) -> None:
    plan = off.plan
    if plan is None:
        logger.info("model %r active on %s: host tensors used in place (no copies)", key,
                    off.device)
        return
    for group, resident in plan.resident.items():
        n = len(off.blocks[group])
        logger.info("model %r active on %s: %s: %d of %d blocks resident %s, %d streamed "
                    "through %d slots (prefetch %d)", key, off.device, group, len(resident), n,
                    list(resident), n - len(resident), plan.ring[group], plan.prefetch)
    logger.info("model %r: %d weight bytes on %s", key, plan.device_bytes, off.device)
