"""What the cache can build: the :class:`Spec` protocol and the three standard specs.

A spec names a resource (``key``), says how many bytes it expects to hold
(``estimated_bytes``, so the cache can make room before building) and builds it (``build()``).
It may also say how many bytes the built value really holds (``nbytes(value)``); without that
method the estimate is charged. Custom specs need not inherit from anything.

The standard specs are frozen dataclasses; the cache compares a spec with the one registered
under the same key (``==``), so keep their factories (and sources) the same objects from call
to call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

from shuttle.errors import CacheError
from shuttle.formats import LoRA, load_lora
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.formats.source import Source
from shuttle.offload import ModelOffloader
from shuttle.offload.coded import Compression
from shuttle.offload.host_storage import HostBacking
from shuttle.patches import Patch

__all__ = ["LoRASpec", "ModelSpec", "ObjectSpec", "Spec", "PROGRESS_MIN_BYTES", "capture_bar",
           "module_bytes"]

logger = logging.getLogger(__name__)

# Progress bars are shown for models and adapters at least this large (and only on a TTY).
PROGRESS_MIN_BYTES = 256 * 2**20


@runtime_checkable
class Spec(Protocol):
    """How to build one cached resource.

    Attributes:
        key: the cache key (hashable, unique within one cache).
        estimated_bytes: bytes the cache reserves before building (None: nothing reserved;
            the exact bytes are charged once built).

    A spec may also define ``nbytes(value) -> int``: the exact bytes the built value holds.
    """

    @property
    def key(self) -> Hashable: ...

    @property
    def estimated_bytes(self) -> int | None: ...

    def build(self) -> Any:
        """Build the resource (called without the cache lock held)."""
        ...


def _check_bytes(owner: str, name: str, value: object, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CacheError(f"{owner}.{name}={value!r}: expected an integer number of bytes >= 0")


@dataclasses.dataclass(frozen=True)
class ObjectSpec:
    """Any object with a stated size: ``factory()`` builds it and ``bytes`` are charged.

    Args:
        key: the cache key.
        factory: builds the object (no arguments).
        bytes: bytes charged for it (also the estimate).
    """

    key: Hashable
    factory: Callable[[], Any]
    bytes: int

    def __post_init__(self) -> None:
        _check_bytes("ObjectSpec", "bytes", self.bytes, optional=False)

    @property
    def estimated_bytes(self) -> int:
        return self.bytes

    def build(self) -> Any:
        """Return ``factory()``."""
        return self.factory()

    def nbytes(self, value: Any) -> int:
        """The stated ``bytes``."""
        return self.bytes


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model kept in host memory by a :class:`~shuttle.offload.ModelOffloader`.

    Args:
        key: the cache key.
        factory: builds a fresh ``nn.Module`` (on the CPU; the cache must be its only owner,
            so do not return a model you keep elsewhere).
        estimated_bytes: host bytes to reserve before building (None: reserve nothing).
        blocks: dotted paths of block lists that may stream (see ``ModelOffloader``).
        host: ``"pinned"`` (page-locked copies) or ``"adopt"`` (keep the CPU tensors).
        sources: qualified tensor name -> its tensor in a safetensors file: the factory's
            model may be built on the ``meta`` device and is filled from there (see
            :class:`~shuttle.offload.HostStorage`).
        compress: ``"lossless"``: keep its bfloat16/float16 weights coded in host memory
            (``ModelOffloader.from_module(compress=...)``; needs ``"pinned"``).

    The built value is the offloader. Its bytes are the host bytes it allocated
    (``storage.host_bytes``) with ``"pinned"``, and the weight bytes it keeps alive with
    ``"adopt"``.
    """

    key: Hashable
    factory: Callable[[], torch.nn.Module]
    estimated_bytes: int | None = None
    blocks: tuple[str, ...] = ()
    host: HostBacking = "pinned"
    sources: Mapping[str, LazyTensor] | None = dataclasses.field(default=None, hash=False)
    compress: Compression | None = None

    def __post_init__(self) -> None:
        if isinstance(self.blocks, str):
            object.__setattr__(self, "blocks", (self.blocks,))
        else:
            object.__setattr__(self, "blocks", tuple(self.blocks))
        _check_bytes("ModelSpec", "estimated_bytes", self.estimated_bytes, optional=True)
        if not callable(self.factory):
            raise CacheError(f"ModelSpec({self.key!r}).factory={self.factory!r}: expected a "
                             "callable that builds the model")
        if self.host not in ("pinned", "adopt"):
            raise CacheError(f"ModelSpec({self.key!r}).host={self.host!r}: expected 'pinned' "
                             "or 'adopt'")
        if self.compress is not None and (self.compress != "lossless" or self.host != "pinned"):
            raise CacheError(f"ModelSpec({self.key!r}).compress={self.compress!r} with "
                             f"host={self.host!r}: expected 'lossless' with host='pinned', "
                             "or None")

    def build(self) -> ModelOffloader:
        """Build the model and capture it into host storage.

        Raises:
            CacheError: the factory returned something other than an ``nn.Module``.
            Whatever the factory or ``ModelOffloader.from_module`` raises.
        """
        start = time.perf_counter()
        model = self.factory()
        if not isinstance(model, torch.nn.Module):
            raise CacheError(f"ModelSpec({self.key!r}).factory returned a "
                             f"{type(model).__name__}, not an nn.Module")
        with capture_bar(f"pinning {self.key}", module_bytes(model)) as bar:
            off = ModelOffloader.from_module(model, blocks=self.blocks, host=self.host,
                                             sources=self.sources, compress=self.compress,
                                             progress=bar.update)
        logger.info("built model %r: %d weight bytes, %d host bytes (%s, %d pinned) in %.2f s",
                    self.key, off.storage.weight_bytes, off.storage.host_bytes, self.host,
                    off.storage.pinned_bytes, time.perf_counter() - start)
        return off

    def nbytes(self, value: ModelOffloader) -> int:
        """Host bytes the offloader holds (see the class docstring)."""
        s = value.storage
        return s.host_bytes if s.host == "pinned" else s.weight_bytes


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """An adapter read into memory once (every tensor loaded, optionally cast).

    Args:
        key: the cache key.
        source: what ``shuttle.load_lora`` accepts (a file, a directory, a state dict).
        dtype: cast floating-point tensors to this dtype while loading (None: keep).
        estimated_bytes: bytes to reserve before loading (None: reserve nothing).

    The built value is a :class:`~shuttle.LoRA` whose tensors are all in memory; its bytes
    are ``LoRA.nbytes``.
    """

    key: Hashable
    source: Source | LoRA
    dtype: torch.dtype | None = None
    estimated_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_bytes("LoRASpec", "estimated_bytes", self.estimated_bytes, optional=True)
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise CacheError(f"LoRASpec({self.key!r}).dtype={self.dtype!r}: expected a "
                             "torch.dtype or None")

    def build(self) -> LoRA:
        """Read the adapter and load every tensor.

        Raises:
            Whatever ``shuttle.load_lora`` raises (``AdapterFileError``, ...).
        """
        lora = load_lora(self.source)
        total = lora.nbytes
        modules: dict[str, list[Patch]] = {}
        # Patch by patch, cast as read: the uncast copy of the whole adapter never exists.
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {self.key}",
                  disable=True if total < PROGRESS_MIN_BYTES else None) as bar:
            for module, patches in lora.modules.items():
                loaded = []
                for p in patches:
                    q = p.load()
                    loaded.append(q if self.dtype is None else _cast(q, self.dtype))
                    bar.update(p.nbytes)
                modules[module] = loaded
        out = dataclasses.replace(lora, modules=modules)
        logger.info("loaded adapter %r: %d patches, %d bytes", self.key,
                    sum(len(ps) for ps in modules.values()), out.nbytes)
        return out

    def nbytes(self, value: LoRA) -> int:
        """``value.nbytes``."""
        return value.nbytes


def _cast(p: Patch, dtype: torch.dtype) -> Patch:
    changes: dict[str, Any] = {}
    for name in type(p).tensor_fields:
        t = getattr(p, name)
        if t is not None and t.is_floating_point() and t.dtype != dtype:
            changes[name] = t.to(dtype)
    inner = getattr(p, "inner", None)  # DoRA wraps another patch
    if isinstance(inner, Patch):
        changes["inner"] = _cast(inner, dtype)
    return dataclasses.replace(p, **changes) if changes else p


@contextlib.contextmanager
def capture_bar(desc: str, total: int, adopting: bool = True) -> Iterator[tqdm]:
    """A progress bar of the bytes a capture reads into host memory (``from_module``'s
    ``progress=bar.update``), shown on a terminal from :data:`PROGRESS_MIN_BYTES`; ``total`` is
    what it expects to read. It ends full: units left on disk by a host ceiling, or adopted
    rather than copied, are never read (``adopting``: a capture that read nothing adopted
    everything, done at once; else it left everything on disk and ends at 0).
    """
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc,
              disable=True if total < PROGRESS_MIN_BYTES else None) as bar:
        yield bar
        if bar.n or not adopting:
            bar.total = bar.n
            bar.refresh()
        else:  # adopted, not copied: done at once
            bar.update(bar.total)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each tensor counted once (tied weights, a
    tensor registered as both), at their storage dtype (a packed 4-bit weight's packed bytes).
    """
    unique = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in unique.values())
