"""Weight representations: one class per storage form of a weight.

Each gives its logical shape and compute dtype, pinning and device copies that keep the form,
``dequantize`` to float32 and ``encode`` (re-encoding after a merge). :func:`represent` finds the
class for a tensor; :func:`register_representation` adds one. :func:`upcast_on_use` lets a
model compute with float8-stored parameters. bitsandbytes, torchao and
optimum-quanto are imported only when a tensor of theirs is met. A DTensor is a
:class:`ShardedWeight` (its local shard and the window of the global weight it holds);
``torch.distributed.tensor`` is never imported for it.
"""

from shuttle.kernels.rounding import round_float, stochastic_round
from shuttle.weights.bnb import Bnb4bitWeight, BnbInt8Weight
from shuttle.weights.fp8 import FP8_DTYPES, Fp8Weight
from shuttle.weights.gguf import GGUF_TYPES, GGUFParameter, GGUFWeight, dequantize_blocks
from shuttle.weights.lossless import LosslessTensor
from shuttle.weights.plain import PLAIN_DTYPES, PlainWeight
from shuttle.weights.quanto import QuantoWeight
from shuttle.weights.representation import (
    REPRESENTATIONS,
    Rounding,
    WeightRepresentation,
    register_representation,
    represent,
)
from shuttle.weights.scaled import ScaledCodes, absmax_encode
from shuttle.weights.torchao import TorchaoInt4Weight, TorchaoScaledWeight
from shuttle.weights.upcast import UpcastHook, Upcasting, upcast_on_use

# isort: split
# Registered last, so represent() asks it first: a DTensor of any dtype (float8 included) is a
# sharded weight, whatever its local tensor is.
from shuttle.weights.dtensor import ShardedWeight, sharded

__all__ = [
    "Bnb4bitWeight",
    "BnbInt8Weight",
    "FP8_DTYPES",
    "GGUF_TYPES",
    "PLAIN_DTYPES",
    "REPRESENTATIONS",
    "Fp8Weight",
    "GGUFParameter",
    "GGUFWeight",
    "LosslessTensor",
    "PlainWeight",
    "QuantoWeight",
    "Rounding",
    "ScaledCodes",
    "ShardedWeight",
    "TorchaoInt4Weight",
    "TorchaoScaledWeight",
    "UpcastHook",
    "Upcasting",
    "WeightRepresentation",
    "absmax_encode",
    "dequantize_blocks",
    "register_representation",
    "represent",
    "round_float",
    "sharded",
    "stochastic_round",
    "upcast_on_use",
]
