"""Bad arguments end in one line on stderr and exit status 2, never a traceback; interruptions
and a closed stdout end quietly (issue 19, items 4, 7, 11, 15)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import shuttle
from shuttle.cli import main
from shuttle.formats.safetensors_writer import TEMP_PREFIX, remove_stale_temps


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    save_file({"lora_unet_first.lora_down.weight": torch.randn(2, 8, generator=g),
               "lora_unet_first.lora_up.weight": torch.randn(6, 2, generator=g),
               "lora_unet_first.alpha": torch.tensor(2.0)}, tmp_path / "kohya.safetensors")
    save_file({"first.lora_A.weight": torch.randn(2, 8, generator=g),
               "first.lora_B.weight": torch.randn(6, 2, generator=g)},
              tmp_path / "peft.safetensors")
    for name in ("base", "tuned"):
        save_file({"first.weight": torch.randn(6, 8, generator=g)},
                  tmp_path / f"{name}.safetensors")
    return tmp_path


def _usage_error(argv, capsys, match):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err


def _extract(files, *extra):
    return ["extract", "--base", str(files / "base.safetensors"), "--tuned",
            str(files / "tuned.safetensors"), "-o", str(files / "e.safetensors"), *extra]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"shuttle {shuttle.__version__}"


@pytest.mark.parametrize(("extra", "match"), [
    (["--rank", "0"], "argument --rank: '0': pass a whole number >= 1"),
    (["--rank", "-3"], "argument --rank"),
    (["--energy", "nan"], "argument --energy: 'nan': pass a fraction in (0, 1]"),
    (["--energy", "2"], "argument --energy"),
    (["--device", "gpu0"], "'gpu0' is not a device name"),
    (["--dtype", "fp8"], "pass one of bf16 (bfloat16), fp16 (float16), fp32 (float32)"),
])
def test_extract_bad_arguments(files, capsys, extra, match):
    _usage_error(_extract(files, *extra), capsys, match)
    assert not (files / "e.safetensors").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["extract", "demo"])
def test_cuda_without_cuda(files, capsys, command):
    argv = _extract(files) if command == "extract" else ["demo"]
    _usage_error([*argv, "--device", "cuda"], capsys, "no cuda device")


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16"])
def test_extract_takes_both_dtype_spellings(files, capsys, spelling):
    assert main(_extract(files, "--dtype", spelling, "--json")) == 0
    back = shuttle.load_lora(files / "e.safetensors")
    assert {r["dtype"] for r in back.describe()} == {"bfloat16"}


def test_convert_kohya_to_peft_is_refused(files, capsys):
    assert main(["convert", str(files / "kohya.safetensors"), str(files / "out"),
                 "--to", "peft"]) == 2
    err = capsys.readouterr().err
    assert "kohya name" in err and "Convert to kohya or comfy" in err
    assert not (files / "out").exists()


@pytest.mark.parametrize(("out", "match"), [
    (".", "is a directory"), ("out.txt", "name the file out.safetensors"),
    ("kohya.safetensors", "is the adapter being converted"),
])
def test_convert_bad_outputs(files, capsys, out, match):
    before = (files / "kohya.safetensors").read_bytes()
    assert main(["convert", str(files / "kohya.safetensors"), str(files / out),
                 "--to", "comfy"]) == 2
    assert match in capsys.readouterr().err
    assert (files / "kohya.safetensors").read_bytes() == before


@pytest.mark.parametrize("command", ["convert", "extract"])
def test_outputs_get_a_new_files_mode(files, capsys, command):
    # as merge's (0666 less the umask), not safetensors' / mkstemp's 0600
    old = os.umask(0o022)
    try:
        if command == "convert":
            assert main(["convert", str(files / "peft.safetensors"),
                         str(files / "e.safetensors"), "--to", "comfy"]) == 0
        else:
            assert main(_extract(files, "--json")) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((files / "e.safetensors").stat().st_mode) == 0o644
    assert not [p for p in files.iterdir() if p.name.startswith(TEMP_PREFIX)]


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_closed_stdout_exits_quietly(files):
    p = subprocess.Popen([sys.executable, "-m", "shuttle.cli", "inspect", "--json",
                          str(files / "peft.safetensors")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # `| head` that read nothing
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_merge_leaves_no_temporary_file(files, signum):
    # The signal arrives while the first output tensor is written: the merge's own cleanup
    # (except BaseException) must run, as it does for Ctrl-C.
    r = _run(f"""
        import os, signal, sys
        from shuttle.formats import safetensors_writer
        from shuttle.cli import main
        # Ctrl-C as in a terminal (a shell's background job starts with SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        write = safetensors_writer.SafetensorsWriter.write
        def killed(self, name, tensor):
            write(self, name, tensor)
            os.kill(os.getpid(), {int(signum)})
        safetensors_writer.SafetensorsWriter.write = killed
        sys.exit(main(["merge", "--base", "base.safetensors", "--lora", "peft.safetensors",
                       "-o", "out/merged.safetensors", "--no-progress"]))
    """, files)
    assert r.returncode == 128 + signum, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list((files / "out").iterdir()) == []


def test_stale_temporaries_are_found_by_name(tmp_path):
    old = tmp_path / f"{TEMP_PREFIX}model.safetensors.1a2b3c4d.safetensors"
    young = tmp_path / f"{TEMP_PREFIX}model.safetensors.5e6f7a8b.safetensors"
    other = tmp_path / ".model.safetensors.tmp"
    for p in (old, young, other):
        p.write_bytes(b"x")
    os.utime(old, (0, 0))
    os.utime(other, (0, 0))
    assert remove_stale_temps(tmp_path, older_than_hours=1) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, other.name])
