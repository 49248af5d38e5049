"""Models built straight from their files: parameters on ``meta``, every weight read once.

The ``from_pretrained`` functions of :mod:`shuttle.integrations.diffusers` and
:mod:`shuttle.integrations.transformers` share what is here:

* :func:`meta_parameters`: modules built inside it get their parameters on the ``meta``
  device (no memory; initializers do nothing) and their buffers real, so a buffer computed at
  construction and never saved (a rotary ``inv_freq``, position ids) holds its value. This is
  what accelerate's ``init_empty_weights(include_buffers=False)`` does, without accelerate.
* :func:`folder_tensors`: the safetensors weights of one model folder (a
  ``*.safetensors.index.json`` with its shards, or the one ``.safetensors`` file), headers only.
* :func:`match_sources`: each of the model's tensors -> its tensor in those files, checked
  before a byte is read. The offloader's capture then reads every tensor once, straight into
  host storage (:class:`~shuttle.offload.HostStorage` ``sources=``): no CPU model exists
  besides shuttle's own arenas.
* :func:`local_folder`: a local folder, or a Hugging Face Hub repo fetched by
  ``huggingface_hub.snapshot_download`` (only the files asked for).

dtypes follow the library that wrote the files: each tensor is read in the dtype the model
built it with (``torch_dtype``, and float32 where the library keeps a module in float32),
converted while read when the file stores another floating-point dtype.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from shuttle.errors import (
    AdapterFileError,
    CheckpointMismatchError,
    InvalidOptionError,
    MissingParameterError,
)
from shuttle.formats.hub import looks_like_repo_id
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.optional import import_optional
from shuttle.weights.fp8 import FP8_DTYPES
from shuttle.weights.lossless_file import open_decoded

__all__ = ["DTYPE_NAMES", "file_tensors", "folder_tensors", "local_folder",
           "match_sources", "meta_parameters", "read_dtype", "unscaled", "weights_dtype"]

logger = logging.getLogger(__name__)

# Weight files of other formats, never downloaded (only safetensors are read).
_OTHER_WEIGHTS = ("*.bin", "*.ckpt", "*.pt", "*.pth", "*.msgpack", "*.h5", "*.onnx",
                  "*.onnx_data", "*.pb", "*.gguf")


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build modules with their parameters on ``meta`` and their buffers real.

    Each parameter registered inside the block is replaced by one of its class on ``meta``
    (same shape, dtype and ``requires_grad``). The constructor's own allocation of a
    parameter is freed untouched (no page of it is ever written, so it costs no resident
    memory), and initializers on ``meta`` tensors do nothing.

    Not thread-safe: it patches ``torch.nn.Module.register_parameter`` for the block.
    """
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            if type(p) is torch.nn.Parameter:
                meta = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
                meta.__dict__.update(p.__dict__)  # attributes set on it stay
            else:  # a subclass's fields are its constructor's keywords (as accelerate builds)
                meta = type(p)(p.to("meta"), **{**p.__dict__, "requires_grad": p.requires_grad})
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def folder_tensors(folder: Path) -> dict[str, LazyTensor]:
    """The safetensors weights of one model folder, by checkpoint key (headers read only).

    A ``*.safetensors.index.json`` (with the shards it names) when there is one, else the
    folder's one ``.safetensors`` file. Variant files (``model.fp16.safetensors``) are not
    read.

    Raises:
        AdapterFileError: no safetensors weights, or several candidates.
        CorruptFileError: a header or index is inconsistent.
        CheckpointMismatchError: a scaled fp8 checkpoint (see :func:`unscaled`).
    """
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    files = sorted(p for p in folder.glob("*.safetensors") if "." not in p.stem)
    if len(indexes) > 1 or (not indexes and len(files) > 1):
        found = ", ".join(p.name for p in (indexes if len(indexes) > 1 else files))
        raise AdapterFileError(f"{folder}: several weight files or indexes ({found}); keep one "
                               "checkpoint per folder (an index names its shards)")
    if not indexes and not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth",
                                                                         ".ckpt"))
        raise AdapterFileError(
            f"{folder}: no .safetensors weights"
            + (f" (only {', '.join(others)}); convert them to safetensors first" if others
               else "; pass a folder written by save_pretrained"))
    path = indexes[0] if indexes else files[0]
    return unscaled(dict(open_decoded(path).tensors), str(path))  # type: ignore[arg-type]


def file_tensors(file: str | os.PathLike[str]) -> dict[str, LazyTensor]:
    """The tensors of one safetensors file (a component's weights given as a file), by key.

    Raises:
        AdapterFileError: no such file, or not a ``.safetensors`` file.
        CorruptFileError: its header is inconsistent.
        CheckpointMismatchError: a scaled fp8 checkpoint (see :func:`unscaled`).
    """
    return unscaled(dict(open_decoded(file).tensors), str(file))  # type: ignore[arg-type]


# Keys of the scale beside a float8 weight in scaled fp8 checkpoints (ComfyUI's "fp8_scaled"
# files: ``<layer>.scale_weight``; its newer layout and llm-compressor's: ``<layer>.weight_scale``).
_SCALE_LEAVES = ("scale_weight", "weight_scale")


def unscaled(tensors: dict[str, LazyTensor], where: str) -> dict[str, LazyTensor]:
    """``tensors``, refused when they are a scaled fp8 checkpoint: float8 weights whose true
    values are the stored ones times a scale kept beside them, which a weight read alone would
    get wrong.

    Raises:
        CheckpointMismatchError: a float8 ``<layer>.weight`` with a ``<layer>.scale_weight`` or
            ``<layer>.weight_scale`` beside it.
    """
    scaled = [k for k in tensors if k.rpartition(".")[2] in _SCALE_LEAVES
              and getattr(tensors.get(k.rpartition(".")[0] + ".weight"), "dtype", None)
              in FP8_DTYPES]
    if scaled:
        raise CheckpointMismatchError(
            f"{where}: a scaled fp8 checkpoint ({len(scaled)} float8 weights with a scale "
            f"beside them, e.g. {scaled[0]!r}); shuttle reads float8 weights unscaled: use the "
            "release in bf16/fp16 or the plain fp8 one (float8 weights alone, e.g. "
            "*_fp8_e4m3fn.safetensors)")
    return tensors


# torch_dtype as a string: transformers' and diffusers' names, and the short ones users type.
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def weights_dtype(torch_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating-point dtype ``torch_dtype`` names (None and ``"auto"``: None, the
    library's own choice); strings as :data:`DTYPE_NAMES` spells them, with or without
    ``torch.``.

    Raises:
        InvalidOptionError: a name or dtype that is not one of those floating-point dtypes.
    """
    if torch_dtype is None or torch_dtype == "auto":
        return None
    dtype = (DTYPE_NAMES.get(torch_dtype.lower().removeprefix("torch."))
             if isinstance(torch_dtype, str) else torch_dtype)
    if dtype not in DTYPE_NAMES.values():
        raise InvalidOptionError(
            f"torch_dtype={torch_dtype!r}: expected torch.bfloat16, torch.float16, "
            f"torch.float32 or torch.float64 (or one of {sorted(DTYPE_NAMES)}, or 'auto' for "
            "the library's own choice); weights load in a floating-point dtype")
    return dtype


def read_dtype(tensors: Mapping[str, LazyTensor]) -> torch.dtype:
    """The dtype of the first floating-point tensor in ``tensors`` (float32 when none is)."""
    return next((t.dtype for t in tensors.values() if t.dtype.is_floating_point),
                torch.float32)


def match_sources(model: torch.nn.Module, tensors: Mapping[str, LazyTensor], where: str, *,
                  names: Callable[[str], Iterable[str]] = lambda key: (key,),
                  ignore: Iterable[str] = (),
                  float32: Callable[[str], bool] = lambda name: False
                  ) -> dict[str, LazyTensor]:
    """Each tensor of ``model`` that the files supply -> its file tensor; checked, not read.

    The model's tensors are those of its ``state_dict`` (parameters and persistent buffers,
    under every name of a tied tensor). A file key is tried under each of ``names(key)``, the
    first the model has wins. Floating-point tensors named by ``float32`` become float32 here
    (their library keeps them so); every other tensor is read in the dtype it was built with.

    Args:
        model: the model, its parameters on ``meta``.
        tensors: checkpoint key -> file tensor.
        where: the folder, for messages.
        names: the model names a checkpoint key may stand for, most likely first.
        ignore: regular expressions of checkpoint keys the model may lack (searched).
        float32: whether the tensor of this model name is kept in float32.

    Returns:
        Model tensor name -> file tensor (for ``sources=``).

    Raises:
        CheckpointMismatchError: file keys the model has no tensor for (beyond ``ignore``), a
            tensor of another shape, or two keys for one tensor.
        MissingParameterError: a parameter (under none of its tied names) is in no file.
        A persistent buffer missing from the files keeps the value the model computed.
    """
    expected = model.state_dict(keep_vars=True)
    found: dict[str, LazyTensor] = {}
    extra = []
    for key, src in tensors.items():
        name = next((n for n in names(key) if n in expected), None)
        if name is None:
            extra.append(key)
        elif name in found:
            raise CheckpointMismatchError(f"{where}: {found[name].key!r} and {key!r} are both "
                                          f"{name!r}; keep one checkpoint per folder")
        else:
            found[name] = src
    patterns = [re.compile(p) for p in ignore]
    extra = [k for k in extra if not any(p.search(k) for p in patterns)]
    shapes = [f"{n} (file {tuple(s.shape)}, model {tuple(expected[n].shape)})"
              for n, s in found.items() if tuple(s.shape) != tuple(expected[n].shape)]
    if extra or shapes:
        raise CheckpointMismatchError(
            f"{where}: the files do not fit the model built from its config: "
            + "; ".join(filter(None, [_listed("tensors the model lacks", extra),
                                      _listed("tensors of another shape", shapes)]))
            + ". Use the config saved with these weights (or the model class they were "
              "written by).")
    tied: dict[int, list[str]] = {}
    for n, t in expected.items():
        tied.setdefault(id(t), []).append(n)
    unsourced = [ns for ns in tied.values() if not any(n in found for n in ns)]
    missing = [ns[0] for ns in unsourced if expected[ns[0]].is_meta]
    if missing:
        raise MissingParameterError(
            f"{where}: {_listed('parameters are in no weight file', missing)}; the files are "
            "incomplete or for another model: download them again, or check the config")
    kept = [ns[0] for ns in unsourced if not expected[ns[0]].is_meta]
    if kept:
        logger.info("%s: %s", where, _listed("buffers keep the values the model computed", kept))
    for name in found:
        t = expected[name]
        if float32(name) and t.is_floating_point() and t.dtype != torch.float32:
            _to_float32(model, name)
    return found


def _to_float32(model: torch.nn.Module, name: str) -> None:
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    if leaf in module._parameters:  # in place: ties and identity stay
        p = module._parameters[leaf]
        p.data = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    else:
        module._buffers[leaf] = module._buffers[leaf].float()


def _listed(what: str, items: Sequence[str]) -> str:
    if not items:
        return ""
    shown = ", ".join(repr(i) for i in items[:6])
    return f"{len(items)} {what} ({shown}{' ...' if len(items) > 6 else ''})"


def local_folder(path_or_repo: str | os.PathLike[str], revision: str | None,
                 allow: list[str], ignore: Sequence[str] = ()) -> Path:
    """A local folder as it is, or a Hub repo's files fetched into the Hugging Face cache.

    Args:
        path_or_repo: a folder, or ``owner/name`` on the Hugging Face Hub.
        revision: the Hub revision (a branch, tag or commit); None: the default branch.
        allow: the repo's files to fetch (``fnmatch`` patterns, e.g. ``"model-*.safetensors"``);
            weights in formats other than safetensors are never fetched.
        ignore: files left out of those.

    Returns:
        The folder (for a repo, its snapshot in the cache: the same folder for every call on
        one revision, so files fetched by several calls lie together).

    Raises:
        AdapterFileError: no such folder, an unknown repo, or the Hub unreachable with the
            files not cached.
        MissingDependencyError: a repo id without ``huggingface_hub`` installed.
    """
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    source = str(path_or_repo)
    if not looks_like_repo_id(source):
        raise AdapterFileError(f"{source}: no such folder (and not an owner/name Hub repo id); "
                               "pass a folder written by save_pretrained")
    hub = import_optional("huggingface_hub", f"reading {source!r} from the Hugging Face Hub "
                          "(or download it and pass its folder)", "pip install huggingface_hub")
    return _snapshot(hub, source, revision, allow, list(ignore))


def _snapshot(hub, repo_id: str, revision: str | None, allow: list[str],
              ignore: list[str]) -> Path:
    errors = import_optional("huggingface_hub.errors", "the Hugging Face Hub",
                             "pip install huggingface_hub")
    try:
        return Path(hub.snapshot_download(repo_id, revision=revision, allow_patterns=allow,
                                          ignore_patterns=[*ignore, *_OTHER_WEIGHTS]))
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        raise AdapterFileError(
            f"{repo_id!r} is neither a local folder nor a Hugging Face repo this machine can "
            f"read ({type(e).__name__}); check the name and revision, or log in for a private "
            "or gated repo") from None
    except OSError as e:  # offline, unreachable, not cached
        raise AdapterFileError(
            f"{repo_id!r}: the Hugging Face Hub cannot be reached and the files are not in the "
            f"local cache ({type(e).__name__}); download them where the Hub is reachable (hf "
            f"download {repo_id}) and pass the folder, or retry online") from None
