"""Extract an adapter from two checkpoints: ``tuned - base`` as low-rank factors where that saves
bytes, as exact dense payloads everywhere else.

Per parameter (one base tensor and its tuned counterpart in memory at a time):

- equal in both: nothing is written (``identical``);
- a ``.weight`` matrix, or a conv weight read as ``(out, in * k...)``, whose delta has a low-rank
  form smaller than itself: ``up = U sqrt(S)``, ``down = sqrt(S) V^T`` from a seeded randomized
  SVD of the float32 delta, with ``alpha = r`` (scale 1) (``lora``);
- anything else (vectors, biases, norms, small matrices, other parameters): the exact delta,
  ``.diff`` / ``.diff_b`` (``diff``);
- only in the tuned checkpoint: its value, ``.set_weight`` (``set``);
- only in the base: reported in :attr:`ExtractReport.base_only` (no payload can remove a weight).

Keys use ComfyUI's spelling, which :func:`~shuttle.load_lora` reads; the written file is read
back and resolved onto the checkpoint's names before it replaces ``out``.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from shuttle.apply.extract_report import ExtractReport, ExtractRow
from shuttle.errors import (
    AdapterFileError,
    CheckpointError,
    DuplicateTargetError,
    NonFiniteAdapterError,
    ShapeMismatchError,
)
from shuttle.formats.lora import LoRA, load_lora
from shuttle.formats.model_checkpoint import CheckpointSource, open_checkpoint, refuse_overwrite
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.formats.safetensors_spool import SafetensorsSpool
from shuttle.patches import materialize
from shuttle.patches.lowrank import split_blocks
from shuttle.patches.patch import Tensorish
from shuttle.targets import resolve

__all__ = ["DEFAULT_RANK", "ExtractReport", "ExtractRow", "extract_lora"]

DEFAULT_RANK = 32
_OVERSAMPLE = 8  # extra sketch columns: the top-r singular values come out accurate
_NITER = 4  # power iterations of the randomized SVD
_FIRST_Q = 32  # energy mode's first sketch width, doubled until the energy is reached
_STORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def extract_lora(
    base: CheckpointSource,
    tuned: CheckpointSource,
    out: str | os.PathLike[str] | None = None,
    *,
    rank: int | None = None,
    energy: float | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    seed: int = 0,
    strict: bool = False,
    prefix: str = "",
) -> ExtractReport:
    """Write the difference of two checkpoints as an adapter.

    Args:
        base: the checkpoint the adapter applies to: a ``.safetensors`` file, a list of them,
            a ``*.safetensors.index.json``, a directory holding one of these, or a state dict.
        tuned: the fine-tuned checkpoint, in any of the same forms.
        out: the ``.safetensors`` file to write (written to a temporary name beside it and
            renamed once complete and read back), or None to return the tensors in the report.
        rank: the rank of each low-rank payload (an upper bound: singular values that are zero
            to float32 precision are dropped). Default :data:`DEFAULT_RANK` when ``energy``
            is not given either.
        energy: instead of ``rank``, per matrix the smallest rank whose factors capture this
            fraction (0, 1] of ``||delta||_F^2``, capped at the largest rank whose factors are
            still smaller than the matrix (the report shows what was captured).
        device: where the SVDs run; default CUDA when available, else the CPU.
        dtype: dtype of the written factors and diffs. Default: factors in the tuned tensor's
            dtype (float32 for other dtypes); diffs in that dtype when it holds them exactly,
            else float32. ``set_weight`` values are always written as they are.
        progress: show a progress bar over tensors (default: when writing to a terminal).
        seed: seeds the randomized SVD (mixed with each parameter's name), so a run repeats.
        strict: raise when a parameter is only in the base, or an integer tensor changed,
            instead of reporting it.
        prefix: put before every key (``"diffusion_model."`` for ComfyUI's generic spelling
            of a standalone diffusion model checkpoint).

    Returns:
        An :class:`ExtractReport`.

    Raises:
        ValueError: ``rank`` / ``energy`` / ``dtype`` out of range, or both ranks given.
        AdapterFileError: an input cannot be opened, or ``out`` is not a ``.safetensors`` path
            in an existing directory.
        OutputIsInputError: ``out`` is one of the input files (or another name of one).
        CorruptFileError: an input's header is inconsistent.
        ShapeMismatchError: a parameter has different shapes in base and tuned.
        CheckpointError: nothing differs; names collide; with ``strict``, a parameter only in
            the base or a changed integer tensor.
        NonFiniteAdapterError: a delta or a new value holds NaN or infinity.
        All of these leave an existing ``out`` untouched.
    """
    rank, energy = _check_args(rank, energy, dtype)
    dev = torch.device(device if device is not None else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    out_path = _check_out(out)
    b_ckpt, t_ckpt = open_checkpoint(base), open_checkpoint(tuned)
    if out_path is not None:
        refuse_overwrite([out_path], [*b_ckpt.files, *t_ckpt.files])
    b_map, t_map = b_ckpt.tensors, t_ckpt.tensors
    _check_pairs(b_map, t_map, strict, prefix)
    base_only = [n for n in b_map if n not in t_map]

    metadata = {"shuttle_extract_base": b_ckpt.name, "shuttle_extract_tuned": t_ckpt.name,
                "shuttle_extract_seed": str(seed)}
    metadata.update({"shuttle_extract_energy": str(energy)} if energy is not None
                    else {"shuttle_extract_rank": str(rank)})
    spool = SafetensorsSpool(out_path.parent) if out_path is not None else None
    collected: dict[str, torch.Tensor] = {}
    emit: Callable[[str, torch.Tensor], None] = (
        spool.add if spool is not None else lambda k, t: collected.__setitem__(k, t.cpu()))
    rows: list[ExtractRow] = []
    skipped: dict[str, str] = {}
    try:
        for name in tqdm(t_map, desc="extracting", unit="tensor",
                         disable=None if progress is None else not progress):
            t = _read(t_map[name])
            b = _read(b_map[name]) if name in b_map else None
            why = _unsupported(b, t)
            if why:
                if strict:
                    raise CheckpointError(f"{name!r}: {why}; pass strict=False to skip it.")
                skipped[name] = why
                continue
            rows.append(_extract_one(name, b, t, emit, rank=rank, energy=energy, device=dev,
                                     dtype=dtype, seed=seed, prefix=prefix))
            del b, t  # one pair in memory at a time
        if not any(r.kind != "identical" for r in rows):
            raise CheckpointError(
                f"{t_ckpt.name} and {b_ckpt.name}: no parameter differs, so there is no adapter "
                "to write; check that tuned is the fine-tuned checkpoint."
            )
        expected = {r.name: r.kind for r in rows if r.kind != "identical"}
        shapes = {n: t.shape for n, t in t_map.items()}
        if spool is None:
            _check_readback(load_lora(collected), expected, shapes, prefix)
            return ExtractReport(rows, base_only, skipped, None, collected, metadata)
        spool.publish(out_path, metadata, lambda tmp: _check_readback(load_lora(tmp), expected,
                                                                       shapes, prefix))
        return ExtractReport(rows, base_only, skipped, out_path, None, metadata)
    finally:
        if spool is not None:
            spool.close()


def _read(ref: Tensorish) -> torch.Tensor:
    # A copy, not a view of the file's map: touched map pages stay resident until the file is
    # closed, so a map would grow the process to the checkpoint's size.
    return ref.load(copy=True) if isinstance(ref, LazyTensor) else materialize(ref)


def _check_args(rank: int | None, energy: float | None,
                dtype: torch.dtype | None) -> tuple[int | None, float | None]:
    if rank is not None and energy is not None:
        raise ValueError(f"rank={rank} and energy={energy} were both given; pass one of them")
    if dtype is not None and dtype not in _STORE_DTYPES:
        raise ValueError(f"dtype={dtype}: pass one of {', '.join(map(str, _STORE_DTYPES))}")
    if energy is not None:
        if not (isinstance(energy, (int, float)) and 0 < energy <= 1):
            raise ValueError(f"energy={energy!r}: pass a fraction in (0, 1], e.g. 0.99")
        return None, float(energy)
    rank = DEFAULT_RANK if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r}: pass a positive integer")
    return rank, None


def _check_out(out: str | os.PathLike[str] | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.suffix != ".safetensors":
        raise AdapterFileError(f"out={str(path)!r}: name the adapter file *.safetensors")
    if not path.parent.is_dir():
        raise AdapterFileError(f"out={str(path)!r}: directory {path.parent} does not exist; "
                               "create it first")
    return path


def _keys(name: str, prefix: str) -> dict[str, str]:
    """Every key a parameter may be written under, by kind (ComfyUI spelling)."""
    module, _, leaf = name.rpartition(".")
    if module and leaf == "weight":
        stem = f"{prefix}{module}"
        return {"diff": f"{stem}.diff", "set": f"{stem}.set_weight",
                "up": f"{stem}.lora_up.weight", "down": f"{stem}.lora_down.weight",
                "alpha": f"{stem}.alpha"}
    if module and leaf == "bias":
        return {"diff": f"{prefix}{module}.diff_b", "set": f"{prefix}{name}.set_weight"}
    return {"diff": f"{prefix}{name}.diff", "set": f"{prefix}{name}.set_weight"}


def _check_pairs(b_map: dict, t_map: dict, strict: bool, prefix: str) -> None:
    """Shapes, base-only parameters and key collisions, from headers, before any data."""
    bad = [f"{n}: base {tuple(b_map[n].shape)} vs tuned {tuple(t.shape)}"
           for n, t in t_map.items() if n in b_map and tuple(b_map[n].shape) != tuple(t.shape)]
    if bad:
        raise ShapeMismatchError(
            f"{len(bad)} parameter(s) differ in shape between base and tuned ({'; '.join(bad[:4])}"
            f"{'; ...' if len(bad) > 4 else ''}); pass a base of the tuned model's architecture."
        )
    base_only = [n for n in b_map if n not in t_map]
    if strict and base_only:
        raise CheckpointError(
            f"{len(base_only)} parameter(s) are only in the base (first: {base_only[0]!r}); an "
            "adapter cannot remove a weight. Pass strict=False to report them instead."
        )
    owner: dict[str, str] = {}
    for n in t_map:
        for key in _keys(n, prefix).values():
            if owner.setdefault(key, n) != n:
                raise CheckpointError(f"parameters {owner[key]!r} and {n!r} would both be "
                                      f"written as {key!r}; rename one of them")


def _unsupported(b: torch.Tensor | None, t: torch.Tensor) -> str:
    """Why no float payload can express this pair ("" when one can, or nothing changed)."""
    if t.is_floating_point() and (b is None or b.is_floating_point()):
        return ""
    if b is not None and b.dtype == t.dtype and torch.equal(b, t):
        return ""  # an unchanged integer tensor (a position-id buffer, say) is just identical
    what = "is new" if b is None else "changed"
    return f"a {t.dtype} tensor {what}; adapters hold float deltas only"


def _extract_one(name: str, b: torch.Tensor | None, t: torch.Tensor,
                 emit: Callable[[str, torch.Tensor], None], *, rank: int | None,
                 energy: float | None, device: torch.device, dtype: torch.dtype | None,
                 seed: int, prefix: str) -> ExtractRow:
    keys = _keys(name, prefix)
    shape = tuple(t.shape)
    row = ExtractRow(name, "identical", shape, dense_bytes=t.numel() * t.element_size())
    if b is None:
        if not torch.isfinite(t).all():
            raise NonFiniteAdapterError(f"tuned {name!r} holds NaN or infinity; fix the "
                                        "checkpoint")
        emit(keys["set"], t.detach().clone())  # a copy: the report must not alias the input
        row.kind, row.bytes = "set", row.dense_bytes
        row.delta_norm = float(t.float().norm())
        return row
    if torch.equal(b, t):
        return row
    bd, td = b.to(device, torch.float32), t.to(device, torch.float32)
    delta = td - bd
    if not torch.isfinite(delta).all():
        raise NonFiniteAdapterError(f"tuned - base of {name!r} holds NaN or infinity; fix the "
                                    "checkpoint that has them")
    row.delta_norm = float(delta.norm())
    note = ""
    if "up" in keys and len(shape) >= 2:
        found = _factorize(delta.reshape(shape[0], -1), rank, energy, seed, name)
        if isinstance(found, str):
            note = found
        else:
            u, s, v, captured, note = found
            factor_dtype = dtype or (t.dtype if t.dtype in _STORE_DTYPES else torch.float32)
            root = s.sqrt()
            up, down = (u * root).to(factor_dtype), (root[:, None] * v.T).to(factor_dtype)
            if keys["up"].endswith(("qkv.lora_up.weight", "linear1.lora_up.weight")) and \
                    len(split_blocks(up, up.shape[1])) > 1:
                # load_lora would read this as a kohya Flux split-qkv save and rescale it.
                note = "a block-diagonal up on a qkv layer reads back rescaled"
            else:
                err = float((delta.reshape(shape[0], -1) - up.float() @ down.float()).norm())
                r = up.shape[1]
                emit(keys["up"], up.reshape(shape[0], r, *[1] * (len(shape) - 2)).cpu())
                emit(keys["down"], down.reshape(r, *shape[1:]).cpu())
                alpha = torch.tensor(float(r), dtype=torch.float32)  # alpha = rank: scale 1
                emit(keys["alpha"], alpha)
                row.kind, row.rank, row.energy, row.note = "lora", r, captured, note
                row.error = err / row.delta_norm
                row.bytes = (up.numel() + down.numel()) * up.element_size() + alpha.element_size()
                return row
    diff = _diff_dtype(delta, t.dtype, dtype)
    got = (bd + diff.float()).to(b.dtype).float()  # what a merge at strength 1 gives
    row.kind, row.note = "diff", note
    row.error = float((got - td).norm()) / row.delta_norm
    row.energy = 1.0 - row.error**2
    row.bytes = diff.numel() * diff.element_size()
    emit(keys["diff"], diff.cpu())
    return row


def _factorize(delta: torch.Tensor, rank: int | None, energy: float | None, seed: int,
               name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, str] | str:
    """``(U, S, V, captured energy, note)`` of the chosen rank, or why a dense diff is better.

    ``U S V^T`` is the best rank-r approximation within the sketch's range, an orthogonal
    projection of ``delta``, so ``sum(S^2) / ||delta||^2`` is exactly the energy captured.
    """
    m, n = delta.shape
    r_max = (m * n - 1) // (m + n)  # the largest r with r * (m + n) < m * n
    if rank is not None and min(m, n) <= rank:
        return f"smaller dimension {min(m, n)} <= rank {rank}"
    if rank is not None and rank > r_max:
        return f"rank {rank} factors are not smaller than the matrix"
    if r_max < 1:
        return "too small for low-rank factors to save bytes"
    total = delta.square().sum()
    devices = list(range(torch.cuda.device_count())) if delta.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        # Seeded per parameter, so a result does not depend on which others were extracted.
        torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
        q = rank if rank is not None else min(_FIRST_Q, r_max)
        while True:
            u, s, v = torch.svd_lowrank(delta, q=min(q + _OVERSAMPLE, m, n), niter=_NITER)
            cum = s[:q].square().cumsum(0) / total
            if rank is not None:
                r = rank
                break
            hit = (cum >= energy).nonzero()
            if hit.numel():
                r = int(hit[0]) + 1
                break
            if q >= r_max:
                r = r_max
                break
            q = min(2 * q, r_max)
    # Directions whose singular value is zero to float32 precision (numpy's matrix_rank rule)
    # add bytes and nothing else: an exact rank-k delta keeps k.
    tol = float(s[0]) * max(m, n) * torch.finfo(torch.float32).eps
    r = max(1, min(r, int((s[:r] > tol).sum())))
    captured = min(1.0, float(cum[r - 1]))
    note = (f"capped at rank {r_max}, the largest smaller than the matrix"
            if energy is not None and r == r_max and captured < energy else "")
    return u[:, :r], s[:r], v[:, :r], captured, note


def _diff_dtype(delta: torch.Tensor, tuned_dtype: torch.dtype,
                dtype: torch.dtype | None) -> torch.Tensor:
    """The float32 delta in the dtype it is stored in.

    ``fl32(tuned - base)`` is the float32 closest to the true difference, so no other stored
    value brings ``base + diff`` (summed in float32, as merges do) closer to ``tuned``: it lands
    on ``tuned`` exactly wherever any float32 can: every element where the two are within a
    factor of two of each other (Sterbenz), and in bf16/fp16 checkpoints every element that did
    not shrink by a factor of thousands (the difference then fits float32's 24 bits).
    """
    if dtype is not None:
        return delta.to(dtype)
    narrow = tuned_dtype if tuned_dtype in (torch.float16, torch.bfloat16) else None
    if narrow is not None and torch.equal(delta.to(narrow).float(), delta):
        return delta.to(narrow)  # stored in the checkpoint's own dtype when that loses nothing
    return delta


def _check_readback(lora: LoRA, expected: dict[str, str], shapes: dict[str, torch.Size],
                    prefix: str) -> None:
    """Every written parameter must read back as itself and its kind, and nothing else."""
    def unprefixed(module: str) -> str | None:
        return module[len(prefix):] if prefix and module.startswith(prefix) else None

    try:
        res = resolve(lora, shapes, mapping=unprefixed)
    except DuplicateTargetError as e:
        raise CheckpointError(f"the adapter's keys do not read back one per parameter ({e})") \
            from None
    got = {t.param: t.patch.kind for t in res.targets}
    if res.unmatched or got != expected:
        wrong = sorted(set(got.items()) ^ set(expected.items()))[:4]
        raise CheckpointError(
            f"the adapter's keys do not read back as the parameters they were made from "
            f"({wrong or list(res.unmatched.items())[:4]}); rename those parameters in the "
            "checkpoints."
        )
