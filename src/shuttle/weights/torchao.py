"""torchao weights: ``Float8Tensor`` and ``Int8Tensor`` (mergeable), ``Int4TilePackedTo4dTensor``
(not mergeable).

``Float8Tensor`` (``Float8WeightOnlyConfig``, ``Float8DynamicActivationFloat8WeightConfig``)
and ``Int8Tensor`` (``Int8WeightOnlyConfig``) store ``qdata`` (float8 / int8, the logical shape)
and a float32 ``scale`` per row ``(rows, 1)`` or per tensor ``(1, 1)``; the weight is
``qdata * scale`` (``Int8Tensor`` also carries a ``zero_point``, all zeros for its symmetric
mapping, which is the only one accepted here). ``encode`` recomputes ``scale = amax / qmax``
at the same granularity (:func:`~shuttle.weights.scaled.absmax_encode`).

``Int4TilePackedTo4dTensor`` (``Int4WeightOnlyConfig`` on CUDA) packs int4 values into
tinygemm's tile layout with group-wise scales and zero points chosen offline; there is no
re-encoding here, so it is not mergeable: adapters over it run in dynamic mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shuttle.errors import UnsupportedLayerError
from shuttle.optional import import_optional
from shuttle.weights.representation import WeightRepresentation, register_representation
from shuttle.weights.scaled import ScaledCodes

__all__ = ["TorchaoInt4Weight", "TorchaoScaledWeight"]


def _torchao_quantization() -> Any:
    """``torchao.quantization``, or an error naming the extra to install."""
    return import_optional("torchao.quantization", "torchao weights",
                           "pip install shuttle[torchao]")


def _is_torchao(tensor: object) -> bool:
    # Checked before importing torchao: only its own tensor subclasses can be its weights.
    return type(tensor).__module__.split(".")[0] == "torchao"


@register_representation("torchao_scaled")
@dataclasses.dataclass
class TorchaoScaledWeight(ScaledCodes):
    """A torchao ``Float8Tensor`` or symmetric ``Int8Tensor``: ``qdata * scale``.

    Attributes:
        qdata: float8 or int8 values of the logical shape.
        scale: float32 ``(rows, 1)`` (per row) or ``(1, 1)`` (per tensor).
        zero_point: ``Int8Tensor``'s (all zero) zero point, kept as is; ``None`` for float8.
        compute: the dtype layers compute in (the tensor's ``dtype``).
        cls: the torchao class (for messages; the form lives in the tensors' dtypes/shapes).
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    compute: torch.dtype
    cls: type = dataclasses.field(default=object, repr=False)

    tensor_names = ("qdata", "scale", "zero_point")
    param_attrs = {"qdata": "qdata", "scale": "scale", "zero_point": "zero_point"}
    shape_field = "qdata"

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        if not _is_torchao(tensor):
            return False
        q = _torchao_quantization()
        return isinstance(tensor, (q.Float8Tensor, q.Int8Tensor))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TorchaoScaledWeight:
        """Wrap a ``Float8Tensor`` / ``Int8Tensor`` (tensors shared, not copied).

        Raises:
            UnsupportedLayerError: an ``Int8Tensor`` with a nonzero zero point (asymmetric).
        """
        zp = getattr(tensor, "zero_point", None)
        if zp is not None and bool((zp != 0).any()):
            raise UnsupportedLayerError(
                "torchao Int8Tensor weights with a nonzero zero_point (asymmetric mapping) are "
                "not supported; quantize with the symmetric mapping (the default)")
        return cls(tensor.qdata, tensor.scale, zp, tensor.dtype, type(tensor))

@register_representation("torchao_int4_tile_packed")
@dataclasses.dataclass
class TorchaoInt4Weight(WeightRepresentation):
    """A torchao ``Int4TilePackedTo4dTensor``: tinygemm-packed int4, group scales and zeros.

    Not mergeable (``encode`` raises :class:`~shuttle.errors.UnmergeableWeightError`); movable,
    countable and dequantizable (on CUDA: through the layer's own int4 matmul, see
    :meth:`dequantize`).

    Attributes:
        qdata: the packed int4 tiles (int32).
        scale_and_zero: group scales and zero points, ``(groups, rows, 2)``.
        block_size: torchao's ``[1, group_size]``.
        shape: the logical shape.
        compute: the dtype layers compute in.
        act_pre_scale: torchao's optional per-input-column scale of the activations.
    """

    qdata: torch.Tensor
    scale_and_zero: torch.Tensor
    block_size: list[int]
    shape: tuple[int, ...]
    compute: torch.dtype
    act_pre_scale: torch.Tensor | None = None

    tensor_names = ("qdata", "scale_and_zero", "act_pre_scale")
    shape_field = "shape"
    mergeable = False

    def dequantize(self) -> torch.Tensor:
        """The weight the layer computes with, float32 ``(out, in)``.

        torchao has no unpacking for this layout (``Tensor.dequantize`` is not implemented for
        it), so the layer's own linear is run on an identity input: row j of ``eye @ W.T`` is
        column j of W, each output a single product, exact in the kernel's float32 sum, as
        the bf16 weight the int4 matmul uses (with ``act_pre_scale`` folded in).
        """
        tensor_cls = _torchao_quantization().Int4TilePackedTo4dTensor
        t = tensor_cls(self.qdata, self.scale_and_zero, self.block_size, torch.Size(self.shape),
                       self.act_pre_scale)
        eye = torch.eye(self.shape[1], dtype=torch.bfloat16, device=self.qdata.device)
        return torch.nn.functional.linear(eye, t).T.float().contiguous()

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        return _is_torchao(tensor) and isinstance(
            tensor, _torchao_quantization().Int4TilePackedTo4dTensor)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TorchaoInt4Weight:
        return cls(tensor.qdata, tensor.scale_and_zero, list(tensor.block_size),
                   tuple(tensor.shape), tensor.dtype, getattr(tensor, "act_pre_scale", None))
