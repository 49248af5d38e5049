"""The public API: every documented name is exported in ``shuttle.__all__`` and resolves."""

from __future__ import annotations

import shuttle

# The names docs/ and README document as ``shuttle.<name>``.
DOCUMENTED = {
    "load_lora", "LoRA", "save_lora", "register_format", "register_patch", "resolve",
    "Resolution", "merge_lora", "MergeReport", "apply_lora", "attach_lora", "DynamicAdapters",
    "lora_scale", "scaled_stream", "load_checkpoint", "LoadReport", "unmerge_lora",
    "UnmergeReport", "AdapterReport", "AutoReport", "Note", "clear_memo", "merge_files",
    "FileMergeReport", "extract_lora", "ExtractReport", "errors", "ModelOffloader",
    "StreamConfig", "OffloadHandle", "ModelCache", "ModelSpec", "LoRASpec", "upcast_on_use",
}
# Names for extending or tuning shuttle, importable from their subpackage only.
SUBPACKAGE = {"PATCH_KINDS": "shuttle.patches", "FORMATS": "shuttle.formats",
              "ObjectSpec": "shuttle.cache", "ResourceCache": "shuttle.cache",
              "LRUEvictionPolicy": "shuttle.cache", "replacement_parameters": "shuttle.apply"}


def test_all_matches_the_documented_api():
    assert set(shuttle.__all__) == DOCUMENTED


def test_every_exported_name_resolves():
    for name in shuttle.__all__:
        assert getattr(shuttle, name) is not None, name


def test_subpackage_names_stay_out_of_the_top_level():
    import importlib

    for name, package in SUBPACKAGE.items():
        assert name not in shuttle.__all__ and not hasattr(shuttle, name), name
        assert getattr(importlib.import_module(package), name) is not None, name


def test_import_needs_no_optional_dependency():
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None; sys.modules['peft'] = None; "
            "sys.modules['diffusers'] = None; import shuttle; print(len(shuttle.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
