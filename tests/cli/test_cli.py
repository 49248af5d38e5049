"""The ``shuttle`` command: inspect, convert and demo, run in-process."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

import shuttle
from shuttle.cli import main


def _kohya_file(path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "lora_unet_blocks_0_attn.lora_down.weight": torch.randn(4, 16, generator=g),
        "lora_unet_blocks_0_attn.lora_up.weight": torch.randn(8, 4, generator=g),
        "lora_unet_blocks_0_attn.alpha": torch.tensor(2.0),
        "lora_unet_blocks_0_norm.diff_b": torch.randn(8, generator=g),
    }
    save_file(sd, str(path))
    return sd


def test_inspect_table(tmp_path, capsys):
    _kohya_file(tmp_path / "a.safetensors")
    assert main(["inspect", str(tmp_path / "a.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "kohya" in out and "lora_unet_blocks_0_attn" in out
    assert "lora x1" in out and "diff x1" in out
    assert "dense payload" in out


def test_inspect_json(tmp_path, capsys):
    _kohya_file(tmp_path / "a.safetensors")
    assert main(["inspect", str(tmp_path / "a.safetensors"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "kohya"
    assert info["modules"] == 2 and info["patches"] == 2
    assert info["ranks"] == {"4": 1}
    assert info["dense_payload_bytes"] == 8 * 4
    row = next(r for r in info["patch_list"] if r["kind"] == "lora")
    assert row["scale"] == 0.5 and row["shapes"] == {"up": [8, 4], "down": [4, 16]}


def test_inspect_bad_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert main(["inspect", str(bad)]) == 2
    assert "corrupt" in capsys.readouterr().err


def test_convert_round_trip(tmp_path, capsys):
    _kohya_file(tmp_path / "a.safetensors")
    assert main(["convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
                 "--to", "comfy"]) == 0
    a = shuttle.load_lora(tmp_path / "a.safetensors")
    b = shuttle.load_lora(tmp_path / "b.safetensors")
    assert a.describe() == b.describe()


def test_demo_passes(capsys):
    assert main(["demo", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True
    assert len(result["rows"]) == 6
    # the memory half: streamed from its file under both budgets, the resident output
    streaming = result["streaming"]
    assert result["streaming_ok"] is True and streaming["output equals resident"] is True
    assert streaming["read from disk"] != "0 B"


def test_python_dash_m_shuttle_runs_the_command_line():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "shuttle", "--version"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"shuttle {shuttle.__version__}"
