"""Typed errors. Every user mistake raises a subclass of :class:`ShuttleError`.

Each message names what is wrong (the file, key or parameter) and what to do about it. When one
of these is raised by a mutating call, nothing was changed (the one exception: an overflow found
by ``load_checkpoint`` mid-load, see :class:`NonFiniteAdapterError`).
"""

from __future__ import annotations

__all__ = [
    "ActivationError",
    "AdapterFileError",
    "AdapterFormatError",
    "AlreadyActiveError",
    "BlockLayoutError",
    "BlockPathError",
    "BudgetTooSmallError",
    "CacheError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCodeError",
    "CorruptFileError",
    "DuplicateResourceKeyError",
    "DuplicateTargetError",
    "EvictionPolicyError",
    "FileChangedError",
    "HostBackingError",
    "HostMemoryError",
    "InvalidOptionError",
    "InvalidStrengthError",
    "MissingDependencyError",
    "MissingParameterError",
    "ModelInUseError",
    "NonFiniteAdapterError",
    "OffloadError",
    "OutputIsInputError",
    "ParameterChangedError",
    "ResourceLeasedError",
    "ResourceNotRegisteredError",
    "ResourceTooLargeError",
    "ScopeOrderError",
    "ShapeMismatchError",
    "ShuttleError",
    "UnknownKeyError",
    "UnmatchedKeysError",
    "UnmergeableWeightError",
    "UnsupportedFormatError",
    "UnsupportedLayerError",
    "UnsupportedModelError",
    "WideningError",
]


class ShuttleError(Exception):
    """Base class of every error shuttle raises for a user mistake or bad input."""


class AdapterFileError(ShuttleError, OSError):
    """An adapter source cannot be opened (missing file, unknown extension, empty directory)."""


class CorruptFileError(AdapterFileError):
    """A file is truncated or its header lies about its contents."""


class CorruptCodeError(ShuttleError, ValueError):
    """A lossless-coded weight failed its checks on decode: its bytes were damaged (a flipped
    bit, a truncated part). Nothing decoded from it is used; read it from a good copy or write
    it again with ``shuttle compress``.
    """


class FileChangedError(AdapterFileError):
    """A file was rewritten, truncated, replaced or deleted after it was opened (its size,
    modification time or inode differ), and its tensors are read only when needed; nothing was
    read from it. Load it again.
    """


class OutputIsInputError(AdapterFileError):
    """An output path is, or would replace, a file being read (the same path, a link to the
    same file, one shard of a sharded input); nothing was written.
    """


class AdapterFormatError(ShuttleError, ValueError):
    """An adapter's keys are malformed (a factor without its partner, a bad alpha, ...)."""


class UnknownKeyError(AdapterFormatError):
    """An adapter holds keys of a kind shuttle does not recognize."""


class UnsupportedFormatError(AdapterFormatError):
    """An adapter uses a known format that shuttle does not implement (OFT, GLoRA, ...)."""


class CheckpointError(ShuttleError, ValueError):
    """Two checkpoints cannot be turned into an adapter as asked (a parameter only in the base
    with ``strict``, a changed integer tensor, no parameter that differs, names that collide).
    """


class CheckpointMismatchError(ShuttleError, ValueError):
    """A model's checkpoint files do not fit the model built from its config: tensors the model
    has no place for (beyond those its library ignores), or of another shape.
    """


class ShapeMismatchError(ShuttleError, ValueError):
    """An adapter's update does not have the shape of the parameter it targets."""


class WideningError(ShapeMismatchError):
    """An adapter takes more input features than its layer has (a control LoRA), where the
    entry point or the layer cannot widen it: only merges widen, and only ``nn.Linear`` weights.
    """


class DuplicateTargetError(ShuttleError, ValueError):
    """Two keys of one adapter resolve onto the same parameter (or overlapping rows of it)."""


class InvalidOptionError(ShuttleError, ValueError):
    """An option names none of its choices (``mode``, ``quality``, ``rounding``): the message
    lists them.
    """


class InvalidStrengthError(ShuttleError, ValueError):
    """A strength or scale is NaN, infinite or not a number."""


class NonFiniteAdapterError(ShuttleError, ValueError):
    """An adapter tensor holds NaN or infinity, or a merge would produce them.

    NaN or infinity in an adapter is found before anything changes. A merge that overflows its
    dtype (float16 beyond 65504) is found while merging: ``merge_lora`` then restores the
    parameters it merged earlier in the call, ``apply_lora`` restores every weight, and
    ``merge_files`` leaves the output as it was (it replaces it only whole), so nothing was
    changed. ``load_checkpoint`` alone keeps the tensors it loaded before the one that
    overflows (its message says so).
    """


class UnmatchedKeysError(ShuttleError, LookupError):
    """With ``strict=True``, adapter keys reached no parameter (an adapter made for another
    model, a wrong ``mapping``); raised before anything changes.

    Attributes:
        unmatched: adapter key -> why it reached no parameter.
    """

    def __init__(self, message: str, unmatched: dict[str, str] | None = None):
        super().__init__(message)
        self.unmatched = dict(unmatched or {})


class ScopeOrderError(ShuttleError, RuntimeError):
    """Merges undone out of order. A scoped merge (``apply_lora``) exited while a later one on
    the same model was still open: the weights keep its merge until the later scope exits,
    which restores both. Or ``unmerge_lora`` was asked to write back a kept merge while a later
    kept merge (or an open ``apply_lora`` block) still holds one of its parameters, or a second
    time: nothing was written.
    """


class ParameterChangedError(ShuttleError, RuntimeError):
    """A parameter that a kept merge (``merge_lora(..., keep=...)``) wrote was replaced or
    written since, so writing the kept copy back would silently discard that change;
    ``unmerge_lora`` wrote nothing.

    Attributes:
        changed: parameter name -> what changed.
    """

    def __init__(self, message: str, changed: dict[str, str] | None = None):
        super().__init__(message)
        self.changed = dict(changed or {})


class UnsupportedLayerError(ShuttleError, TypeError):
    """A patch kind cannot be applied to the layer it targets in the requested mode."""


class UnsupportedModelError(ShuttleError, TypeError):
    """What was passed as a model is neither an ``nn.Module`` nor a diffusers pipeline."""


class MissingDependencyError(ShuttleError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""


class MissingParameterError(ShuttleError, LookupError):
    """A model parameter gets a value from neither the checkpoint nor an adapter (a load)."""


class OffloadError(ShuttleError, ValueError):
    """An offloader cannot be built or activated as asked; nothing was changed."""


class BlockPathError(OffloadError, LookupError):
    """A block path names no module, or not a non-empty ``nn.ModuleList``/``nn.Sequential``."""


class BlockLayoutError(OffloadError):
    """A tensor is shared between a streamed block and another part of the model (the rest,
    or another block).
    """


class HostBackingError(OffloadError):
    """A tensor cannot be kept in host storage as asked (``host="adopt"`` with a non-CPU
    tensor, a meta tensor, a tensor subclass).
    """


class HostMemoryError(OffloadError):
    """Host memory this machine does not have available: a load without ``max_host_bytes``
    that would not fit, or ``max_host_bytes="auto"`` with nothing to give (the message names
    the bytes needed and available).
    """


class BudgetTooSmallError(OffloadError):
    """A VRAM budget is below the floor: the non-block weights plus one slot of each block
    group's largest block, plus the activations (the message names the floor in bytes).
    """


class ActivationError(ShuttleError, RuntimeError):
    """An offloader's activation lifecycle is misused (e.g. activating twice)."""


class AlreadyActiveError(ActivationError):
    """``activate``/``use`` was called while the offloader is already active."""


class CacheError(ShuttleError):
    """A resource cache is used against its rules (budget, leases, keys, policy)."""


class ResourceTooLargeError(CacheError):
    """An entry cannot be admitted (or the budget shrunk) without evicting leased entries.

    Attributes:
        required: bytes the admission (or the smaller budget) needs free.
        used: bytes charged when it was refused.
        limit: the cache's budget (``max_bytes``).
    """

    def __init__(self, message: str, *, required: int, used: int, limit: int):
        super().__init__(message)
        self.required = required
        self.used = used
        self.limit = limit


class EvictionPolicyError(CacheError, RuntimeError):
    """An eviction policy chose keys twice, keys that are not candidates, or too few bytes;
    nothing was evicted.
    """


class ResourceLeasedError(CacheError, RuntimeError):
    """An entry that is leased (or being built) was asked to be evicted."""


class DuplicateResourceKeyError(CacheError, ValueError):
    """A key is registered already (by ``register``, or with a different spec)."""


class ResourceNotRegisteredError(CacheError, LookupError):
    """A key names no entry of the cache."""


class ModelInUseError(CacheError, RuntimeError):
    """``ModelCache.use`` of a model that another ``use`` holds active (uses are sequential)."""


class UnmergeableWeightError(ShuttleError, TypeError):
    """A weight's representation cannot take a merge (GGUF blocks, tile-packed int4): its
    encoding is fixed offline. Apply the adapter with ``mode="dynamic"`` instead.
    """


class StreamModeError(OffloadError):
    """Options of an offloader that do not combine (``compile`` with layer mode, training a
    weight that a merge-mode adapter folds into); the message names the supported choice.
    """


class CheckpointRequiredError(ActivationError):
    """A forward that records autograd ran through a streamed block (or a streamed layer)
    whose device slot is reused before the backward could read it: wrap each streamed block in
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, or run under
    ``torch.no_grad()``.
    """


class PendingGradientError(ActivationError):
    """``optimizer_step()`` ended with gradients still on offloaded trainable parameters; they
    would live on the host while the parameters move back to the device. Clear them inside the
    block (``optimizer.zero_grad()``).
    """


__all__ += ["CheckpointRequiredError", "PendingGradientError", "StreamModeError"]


class AdapterIndexError(ShuttleError, IndexError):
    """An index names no adapter of a dynamic handle (``set_strength``, ``swap``)."""


class DeviceUnavailableError(ShuttleError, RuntimeError):
    """A device was asked for that this machine or this torch build does not have (``"cuda"``
    without a GPU); the message names the device and what to pass instead.
    """


__all__ += ["AdapterIndexError", "DeviceUnavailableError"]


class TrainingError(ShuttleError, RuntimeError):
    """shuttle.train cannot train the model as asked."""


class MergedWeightError(TrainingError):
    """A weight that would be trained is merged with an adapter right now (an open
    ``apply_lora(mode="merge")``): its gradient would be taken against the merged value.
    """


class UnsupportedBaseError(TrainingError, TypeError):
    """A base layer whose weight the training functions cannot read (the module keeps its
    own forward).
    """


__all__ += ["MergedWeightError", "TrainingError", "UnsupportedBaseError"]


class UnsupportedPlacementError(ShuttleError, TypeError):
    """A DTensor placement (or a sharded update) shuttle cannot apply shard by shard: names the
    parameter and the placement; nothing was changed on any rank.
    """


class RankFailedError(ShuttleError, RuntimeError):
    """Another rank of a distributed call failed before any rank changed a weight (its error
    is raised there); this rank changed nothing either.
    """


class RankMismatchError(ShuttleError, RuntimeError):
    """The ranks of a distributed call were given different work (other adapters, strengths,
    rounding, seed or mapping), which would leave shards of different merges; every rank
    raises it and none changed a weight.
    """


__all__ += ["RankFailedError", "RankMismatchError", "UnsupportedPlacementError"]
