"""``shuttle extract``, through its own argparse front (``add_parser`` + ``run``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shuttle
from shuttle.cli import extract
from shuttle.errors import AdapterFileError, OutputIsInputError


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shuttle")
    sub = parser.add_subparsers(dest="command", required=True)
    extract.add_parser(sub)
    return parser.parse_args(["extract", *argv])


def _files(tmp_path) -> tuple[str, str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {"blocks.0.attn.weight": torch.randn(64, 48, generator=g),
            "blocks.0.attn.bias": torch.randn(64, generator=g),
            "blocks.0.norm.weight": torch.randn(64, generator=g),
            "blocks.0.same.weight": torch.randn(8, 8, generator=g)}
    tuned = dict(base)
    tuned["blocks.0.attn.weight"] = base["blocks.0.attn.weight"] + (
        torch.randn(64, 2, generator=g) @ torch.randn(2, 48, generator=g))
    tuned["blocks.0.norm.weight"] = base["blocks.0.norm.weight"] + 0.1
    tuned["blocks.0.extra.weight"] = torch.randn(5, generator=g)
    b, t = tmp_path / "base.safetensors", tmp_path / "tuned.safetensors"
    save_file(base, str(b))
    save_file(tuned, str(t))
    return str(b), str(t), tuned


def test_extract_prints_a_table_and_totals(tmp_path, capsys):
    b, t, _ = _files(tmp_path)
    out = tmp_path / "adapter.safetensors"
    assert extract.run(_parse(["--base", b, "--tuned", t, "-o", str(out), "--rank", "4"])) == 0
    text = capsys.readouterr().out
    assert "blocks.0.attn.weight" in text and "lora" in text and "set" in text
    assert "energy" in text and "dense" in text and "wrote" in text
    assert "blocks.0.same.weight" not in text  # identical parameters are only counted
    assert "identical x2" in text
    lora = shuttle.load_lora(out)
    assert lora.kinds() == {"lora": 1, "diff": 1, "set": 1}


def test_extract_json_energy_and_prefix(tmp_path, capsys):
    b, t, _ = _files(tmp_path)
    out = tmp_path / "adapter.safetensors"
    args = _parse(["--base", b, "--tuned", t, "-o", str(out), "--energy", "0.999",
                   "--prefix", "diffusion_model.", "--json"])
    assert extract.run(args) == 0
    info = json.loads(capsys.readouterr().out)
    row = next(r for r in info["rows"] if r["name"] == "blocks.0.attn.weight")
    assert row["kind"] == "lora" and row["rank"] == 2 and row["error"] < 1e-5
    assert info["metadata"]["shuttle_extract_energy"] == "0.999"
    assert info["counts"] == {"lora": 1, "diff": 1, "identical": 2, "set": 1}
    assert all(k.startswith("diffusion_model.") for k in shuttle.load_lora(out).modules)


def test_extract_several_base_files(tmp_path, capsys):
    b, t, tuned = _files(tmp_path)
    b2 = tmp_path / "base2.safetensors"
    save_file({"late.weight": torch.zeros(3)}, str(b2))
    out = tmp_path / "adapter.safetensors"
    assert extract.run(_parse(["--base", b, str(b2), "--tuned", t, "-o", str(out)])) == 0
    assert "base only     1 parameter(s)" in capsys.readouterr().out


def test_rank_and_energy_are_exclusive(tmp_path):
    with pytest.raises(SystemExit):
        _parse(["--base", "a", "--tuned", "b", "-o", "c", "--rank", "4", "--energy", "0.9"])


def test_missing_input_raises_a_typed_error(tmp_path):
    # shuttle.cli.main turns a ShuttleError into exit status 2 with the message on stderr.
    b, _, _ = _files(tmp_path)
    args = _parse(["--base", b, "--tuned", str(tmp_path / "missing.safetensors"),
                   "-o", str(tmp_path / "o.safetensors")])
    with pytest.raises(AdapterFileError, match="no such file"):
        extract.run(args)
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("via", ["path", "folder"])
def test_refuses_to_overwrite_an_input(tmp_path, via):
    """`-o` the tuned file, named directly or found in a folder passed as the input."""
    b, t, _ = _files(tmp_path)
    (tmp_path / "ft").mkdir()
    t = str((tmp_path / "tuned.safetensors").rename(tmp_path / "ft" / "tuned.safetensors"))
    tuned = t if via == "path" else str(tmp_path / "ft")
    before = Path(t).read_bytes()
    args = _parse(["--base", b, "--tuned", tuned, "-o", t])
    with pytest.raises(OutputIsInputError, match="would overwrite the input"):
        extract.run(args)
    assert Path(t).read_bytes() == before
