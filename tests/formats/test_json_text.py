"""JSON files nested too deep get the typed error of a bad file, never a ``RecursionError``
(issue 37, item 8): ``adapter_config.json``, a checkpoint's index, diffusers' metadata entry and
``shuttle merge --mapping``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import shuttle
from shuttle.cli import main
from shuttle.errors import CorruptFileError
from shuttle.formats.json_text import MAX_JSON_DEPTH, load_json
from shuttle.formats.model_checkpoint import open_checkpoint

# beyond the parser's recursion; deep enough to parse (and to print a screenful of brackets in
# a message); one level past the bound
TOO_DEEP = {"past-the-parser": "[" * 100_000 + "]" * 100_000,
            "parses": '{"r": ' + "[" * 900 + "]" * 900 + "}",
            "one-level-past": '{"r": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}"}


def test_load_json_reads_up_to_the_bound():
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(deepest) == json.loads(deepest)
    assert load_json(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    for text in TOO_DEEP.values():
        with pytest.raises(ValueError, match="nests arrays or objects"):
            load_json(text)


def _adapter(path):
    save_file({"lin.lora_A.weight": torch.ones(2, 4), "lin.lora_B.weight": torch.ones(3, 2)},
              str(path))


@pytest.mark.parametrize("text", TOO_DEEP.values(), ids=TOO_DEEP)
def test_a_deep_adapter_config(tmp_path, text):
    (tmp_path / "ad").mkdir()
    _adapter(tmp_path / "ad" / "adapter_model.safetensors")
    (tmp_path / "ad" / "adapter_config.json").write_text(text)
    with pytest.raises(CorruptFileError, match="adapter_config.json: not valid JSON .*nests"):
        shuttle.load_lora(tmp_path / "ad")


@pytest.mark.parametrize("text", TOO_DEEP.values(), ids=TOO_DEEP)
def test_a_deep_diffusers_metadata_entry(tmp_path, text):
    save_file({"transformer.lin.lora_A.weight": torch.ones(2, 4),
               "transformer.lin.lora_B.weight": torch.ones(3, 2)}, str(tmp_path / "a.safetensors"),
              metadata={"lora_adapter_metadata": text})
    with pytest.raises(CorruptFileError, match="'lora_adapter_metadata' .*nests"):
        shuttle.load_lora(tmp_path / "a.safetensors")


@pytest.mark.parametrize("text", TOO_DEEP.values(), ids=TOO_DEEP)
def test_a_deep_checkpoint_index(tmp_path, text):
    save_file({"lin.weight": torch.ones(3, 4)}, str(tmp_path / "m-1.safetensors"))
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(CorruptFileError, match="not valid JSON .*nests"):
        open_checkpoint(index)


@pytest.mark.parametrize("text", TOO_DEEP.values(), ids=TOO_DEEP)
def test_merge_with_a_deep_mapping_exits_2_in_one_line(tmp_path, capsys, text):
    save_file({"lin.weight": torch.ones(3, 4)}, str(tmp_path / "base.safetensors"))
    _adapter(tmp_path / "ad.safetensors")
    (tmp_path / "mapping.json").write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["merge", "--base", str(tmp_path / "base.safetensors"), "--lora",
              str(tmp_path / "ad.safetensors"), "-o", str(tmp_path / "out.safetensors"),
              "--mapping", str(tmp_path / "mapping.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "mapping.json' is not JSON: nests arrays or objects" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1]) > 0
    assert not (tmp_path / "out.safetensors").exists()
