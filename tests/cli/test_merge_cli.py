"""``shuttle merge``: argument parsing (PATH:STRENGTH, sizes) and a small end-to-end run."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle
from shuttle.apply.merge_files import merge_files
from shuttle.cli import main
from shuttle.cli import merge as merge_cli
from shuttle.errors import InvalidStrengthError, OutputIsInputError


def _parser() -> argparse.ArgumentParser:
    # The subcommand on its own parser, as shuttle.cli.main builds it.
    parser = argparse.ArgumentParser(prog="shuttle")
    merge_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize(("text", "want"), [
    ("a.safetensors", ("a.safetensors", 1.0)),
    ("a.safetensors:0.8", ("a.safetensors", 0.8)),
    ("a.safetensors:-1.5", ("a.safetensors", -1.5)),
    ("a.safetensors:1e-1", ("a.safetensors", 0.1)),
    ("C:\\loras\\a.safetensors", ("C:\\loras\\a.safetensors", 1.0)),
    ("C:\\loras\\a.safetensors:0.5", ("C:\\loras\\a.safetensors", 0.5)),
    ("runs/2024-01-01T10:30/a.safetensors", ("runs/2024-01-01T10:30/a.safetensors", 1.0)),
    ("hf:org/name:0.25", ("hf:org/name", 0.25)),
])
def test_parse_lora(text, want):
    assert merge_cli.parse_lora(text) == want


def test_parse_lora_prefers_an_existing_path(tmp_path):
    odd = tmp_path / "style:2"
    odd.write_bytes(b"")
    assert merge_cli.parse_lora(str(odd)) == (str(odd), 1.0)
    assert merge_cli.parse_lora(f"{odd}:0.5") == (str(odd), 0.5)


def test_parse_lora_rejects_an_empty_strength():
    with pytest.raises(argparse.ArgumentTypeError, match="no strength"):
        merge_cli.parse_lora("a.safetensors:")


@pytest.mark.parametrize(("text", "want"), [
    ("5GB", 5 * 10**9), ("5gb", 5 * 10**9), ("4GiB", 4 * 2**30), ("500MB", 500 * 10**6),
    ("1.5 GiB", 3 * 2**29), ("1024", 1024), ("10KiB", 10240), ("7B", 7),
])
def test_parse_size(text, want):
    assert merge_cli.parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GB", "5 parsecs", "-1GB", "0", "0.1B"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        merge_cli.parse_size(text)


def test_arguments():
    args = _parser().parse_args([
        "merge", "--base", "m.safetensors", "--lora", "a.safetensors:0.8", "--lora",
        "b.safetensors", "-o", "out.safetensors", "--dtype", "bf16", "--rounding", "stochastic",
        "--shard-size", "2GB", "--seed", "3"])
    assert args.base == ["m.safetensors"]
    assert args.lora == [("a.safetensors", 0.8), ("b.safetensors", 1.0)]
    assert (args.out, args.dtype, args.rounding) == ("out.safetensors", torch.bfloat16,
                                                     "stochastic")
    assert (args.shard_size, args.seed) == (2 * 10**9, 3)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16"])
def test_dtype_spellings_match_extract(spelling):
    """merge takes every spelling extract takes (bf16 and bfloat16 alike)."""
    args = _parser().parse_args(["merge", "--base", "m.safetensors", "-o", "o.safetensors",
                                 "--dtype", spelling])
    assert args.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [["--dtype", "int4"], ["--rounding", "up"],
                                 ["--shard-size", "lots"]])
def test_bad_arguments_exit(bad, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["merge", "--base", "m.safetensors", "-o", "o", *bad])


def _files(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).bfloat16()
    base = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(base))
    g = torch.Generator().manual_seed(1)
    lora = tmp_path / "style.safetensors"
    save_file({"lora_unet_0.lora_down.weight": torch.randn(4, 16, generator=g) * 0.1,
               "lora_unet_0.lora_up.weight": torch.randn(32, 4, generator=g) * 0.1,
               "lora_unet_2.lora_down.weight": torch.randn(4, 32, generator=g) * 0.1,
               "lora_unet_2.lora_up.weight": torch.randn(8, 4, generator=g) * 0.1,
               "lora_unet_0.alpha": torch.tensor(2.0)}, str(lora))
    return model, base, lora


def test_end_to_end(tmp_path, capsys):
    model, base, lora = _files(tmp_path)
    out = tmp_path / "merged.safetensors"
    args = _parser().parse_args(["merge", "--base", str(base), "--lora", f"{lora}:0.8",
                                 "-o", str(out), "--no-progress"])
    assert merge_cli.run(args) == 0
    printed = capsys.readouterr().out
    assert "into 2 tensor(s)" in printed and str(out) in printed
    shuttle.merge_lora(model, [(str(lora), 0.8)])
    got = load_file(str(out))
    for k, v in model.state_dict().items():
        assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), k
    with safe_open(str(out), "pt") as f:
        adapters = json.loads(f.metadata()["shuttle.adapters"])
    assert adapters == [{"source": str(lora), "format": "kohya", "strength": 0.8}]


def test_end_to_end_sharded_with_dtype(tmp_path, capsys):
    _, base, lora = _files(tmp_path)
    out = tmp_path / "merged"
    args = _parser().parse_args(["merge", "--base", str(base), "--lora", str(lora), "-o",
                                 str(out), "--dtype", "fp32", "--shard-size", "1KiB",
                                 "--no-progress"])
    assert merge_cli.run(args) == 0
    assert "model.safetensors.index.json" in capsys.readouterr().out
    want = merge_files(base, [(lora, 1.0)], tmp_path / "lib.safetensors", dtype="fp32")
    got: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("model-*.safetensors")):
        got.update(load_file(str(path)))
    ref = load_file(str(want.files[0]))
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_prints_the_notes(tmp_path, capsys):
    """A kohya Flux split-qkv save (block-diagonal up): the report's note is printed."""
    base = tmp_path / "model.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(24, 8)}, str(base))
    lora = tmp_path / "split.safetensors"
    key = "lora_unet_double_blocks_0_img_attn_qkv"
    save_file({f"{key}.lora_up.weight": torch.block_diag(*torch.ones(3, 8, 2)),
               f"{key}.lora_down.weight": torch.ones(6, 8), f"{key}.alpha": torch.tensor(2.0)},
              str(lora))
    args = _parser().parse_args(["merge", "--base", str(base), "--lora", str(lora), "-o",
                                 str(tmp_path / "out.safetensors"), "--no-progress"])
    assert merge_cli.run(args) == 0
    assert "note (kohya-flux-split-qkv, 1 module(s)): " in capsys.readouterr().out


def test_library_errors_propagate_for_main_to_report(tmp_path):
    _, base, lora = _files(tmp_path)
    args = _parser().parse_args(["merge", "--base", str(base), "--lora", f"{lora}:nan",
                                 "-o", str(tmp_path / "o.safetensors")])
    with pytest.raises(InvalidStrengthError):  # main() prints it and exits with status 2
        merge_cli.run(args)
    assert not (tmp_path / "o.safetensors").exists()


def _listing(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("out", ["base", "folder", "hardlink", "symlink", "adapter"])
def test_refuses_to_overwrite_an_input(tmp_path, capsys, out):
    """`-o` naming the base (by path, folder, hard or symbolic link) or an adapter: exit 2,
    and every file stays as it was."""
    _, base, lora = _files(tmp_path)
    target = {"base": base, "folder": tmp_path, "adapter": lora,
              "hardlink": tmp_path / "l.safetensors",
              "symlink": tmp_path / "s.safetensors"}[out]
    if out == "hardlink":
        target.hardlink_to(base)
    if out == "symlink":
        target.symlink_to(base)
    before = _listing(tmp_path)
    status = main(["merge", "--base", str(base), "--lora", str(lora), "-o", str(target),
                   "--no-progress"])
    assert status == 2
    err = capsys.readouterr().err
    assert "would overwrite the input" in err and "nothing was written" in err
    assert _listing(tmp_path) == before


def test_refuses_to_overwrite_a_shard_of_a_sharded_base(tmp_path):
    _, base, lora = _files(tmp_path)
    sharded = merge_files(base, [], tmp_path / "ckpt" / "model.safetensors", max_shard_bytes=1024)
    assert len(sharded.files) > 1
    before = _listing(tmp_path / "ckpt")
    for out in [tmp_path / "ckpt", tmp_path / "ckpt" / "model.safetensors"]:
        with pytest.raises(OutputIsInputError, match="would overwrite the input"):
            merge_files(sharded.index, [(lora, 1.0)], out, max_shard_bytes=1024)
        with pytest.raises(OutputIsInputError):  # the shards given one by one
            merge_files(sharded.files, [(lora, 1.0)], out, max_shard_bytes=1024)
    assert _listing(tmp_path / "ckpt") == before
    # A different output name beside the inputs is fine.
    merge_files(sharded.index, [(lora, 1.0)], tmp_path / "ckpt" / "merged.safetensors")


# -- issue 19: adapters that land nowhere, --strict, truthful NaN reports --------------------

def test_an_adapter_for_another_model_exits_2_and_writes_nothing(tmp_path, capsys):
    _, base, _ = _files(tmp_path)
    other = tmp_path / "other.safetensors"
    save_file({"lora_unet_q_proj.lora_down.weight": torch.ones(4, 16),
               "lora_unet_q_proj.lora_up.weight": torch.ones(32, 4)}, str(other))
    before = _listing(tmp_path)
    status = main(["merge", "--base", str(base), "--lora", str(other),
                   "-o", str(tmp_path / "o.safetensors"), "--no-progress"])
    assert status == 2
    err = capsys.readouterr().err
    assert "no adapter key reached a tensor" in err and "Nothing was written" in err
    assert _listing(tmp_path) == before


def test_strict_fails_on_any_unmatched_key(tmp_path, capsys):
    _, base, lora = _files(tmp_path)
    extra = tmp_path / "extra.safetensors"
    save_file({**load_file(str(lora)), "lora_unet_q_proj.lora_down.weight": torch.ones(4, 16),
               "lora_unet_q_proj.lora_up.weight": torch.ones(32, 4)}, str(extra))
    out = tmp_path / "o.safetensors"
    argv = ["merge", "--base", str(base), "--lora", str(extra), "-o", str(out), "--no-progress"]
    assert main([*argv, "--strict"]) == 2
    assert "lora_unet_q_proj" in capsys.readouterr().err and not out.exists()
    assert main(argv) == 0  # without --strict: merged, the unmatched key listed
    printed = capsys.readouterr().out
    assert "into 2 tensor(s)" in printed and "lora_unet_q_proj" in printed


def test_a_nan_adapter_is_reported_as_such(tmp_path, capsys):
    _, base, lora = _files(tmp_path)
    sd = load_file(str(lora))
    sd["lora_unet_2.lora_up.weight"][0, 0] = float("nan")
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad))
    out = tmp_path / "o.safetensors"
    assert main(["merge", "--base", str(base), "--lora", str(bad), "-o", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds NaN or infinity" in err and "lora_unet_2" in err
    assert "lower the strength" not in err and "keep their merge" not in err
    assert not out.exists()


@pytest.mark.parametrize("name", ["out.bin", "out.pt", "out.ckpt"])
def test_an_output_named_as_another_format_is_refused(tmp_path, name):
    """extract refuses such names; merge used to take them for a directory to create."""
    _, base, lora = _files(tmp_path)
    with pytest.raises(shuttle.errors.ShuttleError, match="safetensors only"):
        merge_files([str(base)], [(str(lora), 1.0)], tmp_path / name, progress=False)
    assert not (tmp_path / name).exists()


def test_mapping_places_keys_no_rule_knows(tmp_path, capsys):
    model, base, _ = _files(tmp_path)
    g = torch.Generator().manual_seed(2)
    lora = tmp_path / "odd.safetensors"
    save_file({"first.lora_down.weight": torch.randn(4, 16, generator=g) * 0.1,
               "first.lora_up.weight": torch.randn(32, 4, generator=g) * 0.1,
               "last.lora_down.weight": torch.randn(2, 32, generator=g) * 0.1,
               "last.lora_up.weight": torch.randn(4, 2, generator=g) * 0.1}, str(lora))
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"first": "0", "last": ["2", [4, 8]]}))
    out = tmp_path / "merged.safetensors"
    args = _parser().parse_args(["merge", "--base", str(base), "--lora", str(lora), "-o",
                                 str(out), "--mapping", str(mapping), "--strict",
                                 "--no-progress"])
    assert merge_cli.run(args) == 0
    shuttle.merge_lora(model, [(str(lora), 1.0)], mapping={"first": "0", "last": ("2", (4, 8))},
                       strict=True)
    got = load_file(str(out))
    for k, v in model.state_dict().items():
        assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), k


def test_mapping_rows_past_the_tensor_exit_2_saying_so(tmp_path, capsys):
    """Layer 2 has 8 rows: rows 4:12 are past them, not an overlap with 0:4."""
    _, base, _ = _files(tmp_path)
    g = torch.Generator().manual_seed(2)
    lora = tmp_path / "odd.safetensors"
    save_file({f"{k}.lora_down.weight": torch.randn(2, 32, generator=g) for k in ("lo", "hi")} |
              {"lo.lora_up.weight": torch.randn(4, 2, generator=g),
               "hi.lora_up.weight": torch.randn(8, 2, generator=g)}, str(lora))
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"lo": ["2", [0, 4]], "hi": ["2", [2, 10]]}))
    out = tmp_path / "merged.safetensors"
    assert main(["merge", "--base", str(base), "--lora", str(lora), "-o", str(out),
                 "--mapping", str(mapping), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "'hi' is sent to rows 2:10 of '2.weight': past the tensor's 8 rows" in err, err
    assert not out.exists()


@pytest.mark.parametrize(("text", "why"), [
    ("[1, 2]", "expected a JSON object"), ("{nope", "is not JSON"),
    ('{"a": 3}', "the value of 'a'"), ('{"a": ["p", [0]]}', "the value of 'a'"),
])
def test_a_bad_mapping_file_exits_naming_it(tmp_path, capsys, text, why):
    mapping = tmp_path / "mapping.json"
    mapping.write_text(text)
    with pytest.raises(SystemExit):
        _parser().parse_args(["merge", "--base", "m.safetensors", "-o", "o", "--mapping",
                              str(mapping)])
    assert why in capsys.readouterr().err
