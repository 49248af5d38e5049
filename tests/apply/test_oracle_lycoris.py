"""LyCORIS adapters written by lycoris-lora itself, run by shuttle, against LyCORIS's forward.

``lycoris.create_lycoris(model, 1.0, dim, alpha, algo=..., ...)`` wraps the Linear, Conv1d and
Conv2d layers of :class:`~tests.apply.oracle_models.Layers` (LyCORIS has no Embedding module;
``train_norm=True`` adds the LayerNorm), its parameters are set to random values and
``save_weights`` writes the safetensors file. shuttle loads the file and runs it merged and
dynamic at strength ``k``; the oracle is LyCORIS's own forward after ``set_multiplier(k)``
(not ``merge_to``: lycoris-lora 4.1.3's LoHa/LoKr ``merge_to`` applies ``(alpha / r)^2``).

DyLoRA's training forward draws a random rank each call; its file is plain LoRA keys, so its
oracle is LyCORIS's inference load of the file, ``create_lycoris_from_weights(k, file, model,
weights_sd)``. DyLoRA saves a conv's ``lora_up`` as ``(out, r)``, which LyCORIS's own loader
cannot copy into its ``(out, r, 1, 1)`` layer (a LyCORIS bug), so the oracle is given those ups
reshaped to ``(out, r, 1, 1)``; the file shuttle reads is unchanged.

Diag-OFT and BOFT with ``rescaled`` are compared at strength 1 only: LyCORIS applies the row
scale whole at any multiplier, shuttle moves it with the strength (docs/formats.md).

The algorithms shuttle does not implement (GLoRA, T-LoRA) must be refused when the file is
read, with a typed error that names the algorithm and a key.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from safetensors.torch import load_file

import shuttle
from shuttle.errors import ShuttleError, UnsupportedFormatError
from tests.apply.oracle_models import (
    MODES,
    STRENGTHS,
    assert_outputs_close,
    make_base,
    outputs,
    randomize,
    shuttle_outputs,
)

lycoris = pytest.importorskip("lycoris")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WRAPPED = {"lin", "c1", "c2", "sq"}
DIM, ALPHA = 4, 2.0  # alpha != dim: a scale that is not 1

# name -> create_lycoris keyword arguments
CONFIGS = {
    "lora": {"algo": "lora"},
    "locon-tucker": {"algo": "locon", "use_tucker": True},
    "lora-scalar": {"algo": "lora", "use_scalar": True},
    "lora-norm": {"algo": "lora", "train_norm": True},
    "lora-dora": {"algo": "lora", "dora_wd": True},
    "lora-dora-columns": {"algo": "lora", "dora_wd": True, "wd_on_output": False},
    "loha": {"algo": "loha"},
    "loha-tucker": {"algo": "loha", "use_tucker": True},
    "loha-dora": {"algo": "loha", "dora_wd": True},
    "lokr": {"algo": "lokr"},
    "lokr-decompose-both": {"algo": "lokr", "decompose_both": True},
    "lokr-tucker": {"algo": "lokr", "decompose_both": True, "use_tucker": True},
    "lokr-factor": {"algo": "lokr", "factor": 4},
    "lokr-full-matrix": {"algo": "lokr", "full_matrix": True},
    "lokr-dora": {"algo": "lokr", "dora_wd": True},
    "full": {"algo": "full"},
    "ia3": {"algo": "ia3"},
    "diag-oft": {"algo": "diag-oft"},
    "diag-oft-constrained": {"algo": "diag-oft", "constraint": 1e-3},
    "boft": {"algo": "boft"},
    "boft-constrained": {"algo": "boft", "constraint": 1e-3},
}


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("LyCORIS").setLevel(logging.ERROR)


def lycoris_net(base, path, **kwargs):
    """LyCORIS's network on a copy of ``base``, random weights, saved to ``path``."""
    model = copy.deepcopy(base)
    net = lycoris.create_lycoris(model, 1.0, DIM, ALPHA, **kwargs)
    net.apply_to()
    randomize(net.named_parameters())
    net.save_weights(str(path), torch.float32, None)
    return net, model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STRENGTHS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_lycoris_forward(name, k, mode, tmp_path):
    base = make_base()
    path = tmp_path / "a.safetensors"
    net, model = lycoris_net(base, path, **CONFIGS[name])
    net.set_multiplier(k)
    expected = outputs(model)

    lora = shuttle.load_lora(path)
    assert lora.format == "lycoris"
    adapted = WRAPPED | ({"norm"} if CONFIGS[name].get("train_norm") else set())
    assert len(lora.modules) == len(adapted)
    assert_outputs_close(shuttle_outputs(base, lora, k, mode), expected, outputs(base), adapted)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["diag-oft", "boft"])
def test_rescaled_oft_matches_lycoris_forward(algo, mode, tmp_path):
    base = make_base()
    path = tmp_path / "a.safetensors"
    net, model = lycoris_net(base, path, algo=algo, rescaled=True)
    expected = outputs(model)
    lora = shuttle.load_lora(path)
    assert {p.kind for ps in lora.modules.values() for p in ps} == {"oft"}
    assert_outputs_close(shuttle_outputs(base, lora, 1.0, mode), expected, outputs(base), WRAPPED)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STRENGTHS)
def test_dylora_matches_lycoris_load(k, mode, tmp_path):
    base = make_base()
    path = tmp_path / "a.safetensors"
    lycoris_net(base, path, algo="dylora", block_size=2)
    model = copy.deepcopy(base)
    sd = load_file(str(path))
    for key, up in sd.items():
        down = sd.get(key.replace("lora_up", "lora_down"))
        if key.endswith("lora_up.weight") and down is not None and down.dim() > up.dim():
            sd[key] = up.reshape(*up.shape, *[1] * (down.dim() - 2))
    net, _ = lycoris.create_lycoris_from_weights(k, str(path), model, weights_sd=sd)
    net.apply_to()
    expected = outputs(model)
    got = shuttle_outputs(base, shuttle.load_lora(path), k, mode)
    assert_outputs_close(got, expected, outputs(base), WRAPPED)


UNSUPPORTED = {
    "glora": ("GLoRA", "a1.weight"),
    "tlora": ("T-LoRA", "lambda_layer"),
}


@pytest.fixture(scope="module")
def unsupported_file(tmp_path_factory):
    """algo -> a file LyCORIS wrote for it, made once per module (T-LoRA's takes a second)."""
    files = {}

    def get(algo: str):
        if algo not in files:
            files[algo] = tmp_path_factory.mktemp(algo) / "a.safetensors"
            lycoris_net(make_base(), files[algo], algo=algo)
        return files[algo]

    return get


@pytest.mark.parametrize("algo", list(UNSUPPORTED))
def test_unsupported_algorithm_is_a_typed_error(algo, unsupported_file):
    with pytest.raises(ShuttleError, match=UNSUPPORTED[algo][1]):
        shuttle.load_lora(unsupported_file(algo))


@pytest.mark.parametrize("algo", list(UNSUPPORTED))
def test_unsupported_algorithm_is_named(algo, unsupported_file):
    with pytest.raises(UnsupportedFormatError, match=UNSUPPORTED[algo][0]):
        shuttle.load_lora(unsupported_file(algo))
