"""Weight representations: one class per storage form of a weight.

Each gives its logical shape and compute dtype, pinning and device copies that keep the form,
``dequantize`` to float32 and ``encode`` (re-encoding after a merge). :func:`represent` finds the
class for a tensor; :func:`register_representation` adds one.
"""

from shuttle.weights.fp8 import FP8_DTYPES, Fp8Weight
from shuttle.weights.gguf import GGUF_TYPES, GGUFWeight, dequantize_blocks
from shuttle.weights.plain import PLAIN_DTYPES, PlainWeight
from shuttle.weights.representation import (
    REPRESENTATIONS,
    Rounding,
    WeightRepresentation,
    register_representation,
    represent,
)
from shuttle.weights.rounding import round_float, stochastic_round

__all__ = [
    "FP8_DTYPES",
    "GGUF_TYPES",
    "PLAIN_DTYPES",
    "REPRESENTATIONS",
    "Fp8Weight",
    "GGUFWeight",
    "PlainWeight",
    "Rounding",
    "WeightRepresentation",
    "dequantize_blocks",
    "register_representation",
    "represent",
    "round_float",
    "stochastic_round",
]
