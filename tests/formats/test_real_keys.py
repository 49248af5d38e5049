"""Load synthetic adapters with the exact key names and shapes of published files.

Each JSON in ``tests/data/real_keys/`` records one adapter's tensor names and shapes. The
tests write a ``.safetensors`` file with those names and shapes (small random values) and check
that ``load_lora`` detects the format, uses every key, and that ``describe()`` and the
``inspect`` command cover every module.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shuttle
from shuttle.patches import DoRA, LowRank

REAL_KEYS = Path(__file__).parents[1] / "data/real_keys"
FILES = sorted(p.name for p in REAL_KEYS.glob("*.json"))

# The key family each file belongs to, decided from the detection rules (lowest priority wins):
# lycoris (lokr_w1 markers) < kohya (lora_down / lora_unet_ ...) < peft (base_model.model.)
# < diffusers (lora_A on any other names, including ComfyUI's diffusion_model. prefix).
EXPECTED_FORMAT = {
    "anima-kohya-te.json": "kohya",
    "anima-kohya.json": "kohya",
    "anima-lokr-dora.json": "lycoris",
    "anima-peft.json": "diffusers",  # lora_A on diffusion_model. names, no base_model.model.
    "flux-dev-aitoolkit.json": "diffusers",  # lora_A on diffusion_model. names
    "flux-dev-bfl-control.json": "bfl-control",
    "flux-dev-diffusers-no-proj-mlp.json": "diffusers",
    "flux-dev-diffusers-norm-out.json": "diffusers",
    "flux-dev-diffusers.json": "diffusers",
    "flux-dev-dora.json": "kohya",  # lora_transformer_ + lora_down/up + dora_scale
    "flux-dev-kohya-te1-te3.json": "kohya",
    "flux-dev-kohya-te1.json": "kohya",
    "flux-dev-kohya.json": "kohya",
    "flux-dev-lokr.json": "lycoris",
    "flux-dev-onetrainer-dora.json": "kohya",
    "flux-dev-peft.json": "peft",
    "flux-dev-xlabs.json": "xlabs",
    "krea2-kohya.json": "kohya",
    "qwen-image-diffusers.json": "kohya",  # diffusers names, but kohya's lora_down/lora_up/alpha
    "qwen-image-kohya-lokr.json": "lycoris",
}

# Patch kinds each file must yield (the main kind, plus dense ones for the control LoRA).
EXPECTED_KINDS = {
    "anima-lokr-dora.json": {"dora", "lokr"},
    "flux-dev-bfl-control.json": {"lora", "diff", "set"},
    "flux-dev-dora.json": {"dora"},
    "flux-dev-lokr.json": {"lokr"},
    "flux-dev-onetrainer-dora.json": {"dora"},
    "qwen-image-kohya-lokr.json": {"lokr"},
}

_ALPHA = 8.0
_DTYPE = torch.float16


def _layout(name: str) -> dict[str, list[int]]:
    return json.loads((REAL_KEYS / name).read_text())


def write_safetensors(keys: dict[str, list[int]], path: Path) -> None:
    """Write a float16 safetensors file with these names and shapes.

    Every non-scalar tensor holds the leading part of one random pool (small values, no zeros
    on purpose), so that files of ~1.7 GB are written without allocating each tensor; scalars
    (``alpha``) hold ``_ALPHA``. The layout is the safetensors one: header length, JSON header
    padded to 8 bytes, then the data.
    """
    numels = {k: math.prod(s) for k, s in keys.items()}
    pool = (torch.rand(max(numels.values()), dtype=torch.float32) * 0.02 + 0.001).to(_DTYPE)
    pool_bytes = memoryview(pool.numpy()).cast("B")
    alpha_bytes = torch.tensor(_ALPHA, dtype=_DTYPE).numpy().tobytes()
    item = torch.empty((), dtype=_DTYPE).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k, s in keys.items():
        n = numels[k] * item
        header[k] = {"dtype": "F16", "shape": s, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k, s in keys.items():
            f.write(alpha_bytes if s == [] else pool_bytes[: numels[k] * item])


@pytest.fixture(scope="module")
def adapter_file(tmp_path_factory):
    """``adapter_file(name)`` -> path of the synthesized file (written once per module, ~4.5 GB
    for all files together, removed at the end).
    """
    folder = tmp_path_factory.mktemp("real-keys")
    written: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in written:
            path = folder / name.replace(".json", ".safetensors")
            write_safetensors(_layout(name), path)
            written[name] = path
        return written[name]

    yield make
    for path in written.values():
        path.unlink(missing_ok=True)


def _consumed_keys(lora: shuttle.LoRA) -> set[str]:
    """File keys referenced by the patches: their tensors, plus alphas read into scales."""
    used = set()
    for module, p in lora.patches():
        for _, t in p.tensors():
            used.add(t.key)
        if p.alpha is not None:
            used.add(f"{module}.alpha")
    return used


def test_expected_table_covers_every_file():
    assert set(EXPECTED_FORMAT) == set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_load_real_layout(name, adapter_file):
    keys = _layout(name)
    lora = shuttle.load_lora(adapter_file(name))

    assert lora.format == EXPECTED_FORMAT[name]
    assert lora.skipped == {}
    assert _consumed_keys(lora) == set(keys)
    # Each tensor belongs to exactly one patch.
    n_tensors = sum(len(list(p.tensors())) for _, p in lora.patches())
    assert n_tensors == sum(1 for s in keys.values() if s != [])
    if name in EXPECTED_KINDS:
        assert set(lora.kinds()) == EXPECTED_KINDS[name]
    # Alphas were read into scales: alpha / rank for every low-rank patch.
    for _, p in lora.patches():
        inner = p.inner if isinstance(p, DoRA) else p
        if isinstance(inner, LowRank) and inner.alpha is not None:
            assert inner.alpha == _ALPHA
            assert inner.scale == pytest.approx(_ALPHA / inner.rank)

    rows = lora.describe()
    assert {r["module"] for r in rows} == set(lora.modules)
    assert len(rows) == sum(len(ps) for ps in lora.modules.values())
    assert all(r["dtype"] == "float16" for r in rows)
    assert sum(r["bytes"] for r in rows) == lora.nbytes == 2 * sum(
        math.prod(s) for s in keys.values() if s != [])


def test_split_qkv_rule_reads_up(tmp_path):
    """A kohya Flux qkv module with an alpha is a split-qkv candidate; dense random ``up``
    factors are not block diagonal, so the scale stays alpha / rank.
    """
    keys = {k: s for k, s in _layout("flux-dev-kohya.json").items()
            if k.startswith("lora_unet_double_blocks_0_img_attn_qkv.")}
    path = tmp_path / "qkv.safetensors"
    write_safetensors(keys, path)
    (patch,) = shuttle.load_lora(path).modules["lora_unet_double_blocks_0_img_attn_qkv"]
    assert patch.split_qkv
    assert patch.effective_scale == pytest.approx(_ALPHA / patch.rank)


def _cli():
    return pytest.importorskip("shuttle.cli", reason="shuttle.cli is not importable yet")


@pytest.mark.parametrize("name", FILES)
def test_inspect_json_real_layout(name, adapter_file, capsys):
    cli = _cli()
    path = adapter_file(name)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    lora = shuttle.load_lora(path)
    assert info["format"] == EXPECTED_FORMAT[name]
    assert info["modules"] == len(lora.modules)
    assert info["skipped"] == {}
    assert {r["module"] for r in info["patch_list"]} == set(lora.modules)
    assert info["patches"] == len(info["patch_list"]) == len(lora.describe())


def test_inspect_command_line(tmp_path):
    _cli()
    path = tmp_path / "xlabs.safetensors"
    write_safetensors(_layout("flux-dev-xlabs.json"), path)
    out = subprocess.run(
        [sys.executable, "-m", "shuttle.cli", "inspect", str(path), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["format"] == "xlabs"
    assert info["modules"] == 12
    assert info["skipped"] == {}
