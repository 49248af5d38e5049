"""``shuttle cast IN OUT``: a model folder written again in the dtypes it computes in."""

from __future__ import annotations

import json

import pytest
import torch

from shuttle.cli import main
from shuttle.formats.safetensors_file import SafetensorsFile
from tests.integrations.models import tiny_llama

pytest.importorskip("transformers")


def test_the_command_line_casts_a_folder_and_refuses_an_existing_target(tmp_path, capsys):
    tiny_llama().save_pretrained(tmp_path / "f32")  # float32
    assert main(["cast", str(tmp_path / "f32"), str(tmp_path / "out"), "--dtype", "float16",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == 1 and report["cast"] == report["tensors"] > 0
    assert report["bytes_after"] * 2 == report["bytes_before"]
    f = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    assert {f.tensor_ref(k).dtype for k in f} == {torch.float16}
    assert main(["cast", str(tmp_path / "f32"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["cast", str(tmp_path / "f32"), str(tmp_path / "out"), "--force",
                 "--quiet"]) == 0
    assert "tensors cast to bfloat16" in capsys.readouterr().out
