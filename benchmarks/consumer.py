"""The machines users own: a real-size FluxPipeline read from a diffusers folder on disk, under
a grid of VRAM and host budgets.

The pipeline (Flux-dev transformer, T5-XXL, CLIP-L, VAE; random bf16 weights drawn as e2e.py
draws them; 33.7 GB) is written once with ``save_pretrained`` to --folder (on the device's
disk) and every cell loads it with ``shuttle.integrations.diffusers.from_pretrained(folder,
vram_budget=V, max_host_bytes=H)``: modules built on ``meta``, weights read straight from the
files, what the host budget does not hold read from disk on every pass. One call: e2e.py's
prompt, 1024x1024, 4 steps (``--smoke``: tiny components, 128x128, 2 steps).

``--model flux-fp8`` writes the same pipeline with its transformer's linear weights in
float8_e4m3fn (an fp8 release, 12.0 GB of transformer): shuttle keeps them float8 in host
memory, on disk and over the bus, computing in bf16 (``from_pretrained(float8="keep")``); the
resident reference is diffusers' own load of that folder, which widens them to bf16.

``--model wan14b`` runs a WanPipeline of Wan2.1-T2V-14B's shapes instead (about 40 GB; one call:
480x832, 33 frames, 2 steps with guidance), the issue's row at 6 GiB VRAM and 16 GiB host.

Cells: --vram (GiB; ``floor``: the smallest budget that runs with that host cell, 2% above
the floor named by the ``BudgetTooSmallError`` of a budget below it, raised to the floor a
refusal after the first call names when its activations do not fit; a later host cell of the
same kind starts from the floor an earlier one ran at, this run's or --rows-from's) x --host
(GiB; ``none``: no ceiling; a host ``H:lossless`` loads with ``compress="lossless"``: what the
ceiling holds is kept coded, 1.5x as many units, and the rest is read plain from the files;
``H:compressed`` loads a copy of the folder whose weight files ``shuttle compress`` wrote, made
once beside it: held and read coded, about 0.67x the bytes from disk; 22.7 GB more on the disk
for Flux, so not beside the disk peers' copies on a 64 GiB disk). Each cell runs in its own process
(``consumer.py --worker V H``), so that its peak VRAM (``max_memory_allocated`` from the load
on) and peak RSS (VmRSS sampled every 10 ms) are its own; the worker loads, makes one warm-up
call (--warmup-steps denoising steps, 1 by default: the first call measures each module's
activations and plans from them, and one step does what every step does) and --runs timed
calls (wall clock between device synchronizations), and saves its output, compared with the
resident pipeline's (a ``resident`` worker: the same folder loaded by diffusers onto the
device).

Peers (--peers), each a cell of its own on the same folder, no host ceiling (none takes one):
diffusers' group offloading (block level, one block per group, streamed) with its groups on
disk (``offload_to_disk_path``); accelerate's ``disk_offload`` of every component; mmgp's
profiles 4 and 5 with nothing quantized (``quantizeTransformer=False, extraModelsToQuantize=[]``,
so the outputs compare).

Per cell: seconds per image, peak VRAM, peak RSS, bytes read from disk per image
(``/proc/self/io`` read_bytes: page-cache hits excluded, O_DIRECT included), load seconds
(the pipeline's and its components' classes imported first, as every row's process does:
diffusers imports them lazily, seconds of module imports recorded apart as ``import_s``),
load seconds over one plain read of the folder's files (its bytes at the disk's read ceiling
below), bit-identity with the resident output, resident memory by kind after the load and
after the calls (``/proc/self/status`` RssAnon/RssFile: what a cell holds beyond its
ceiling), and the bound max(compute, bytes copied to the device / pinned bandwidth, bytes from
disk / the disk's read ceiling): compute is the resident call's time, the bandwidths are
measured in the same run (pinned host-to-device copies; O_DIRECT reads of the folder's largest
file with 1, 4 and 16 reads in flight, the best), the page cache dropped before each worker
where allowed. Bytes copied to the device are what each call of an offloaded module streams by
its plan at that call and what each activation places (its non-block weights and resident
blocks; a module moved whole, all of it): a module is activated again at each image when
another took its room.

    PYTHONPATH=src python benchmarks/consumer.py --folder /tmp/flux --vram floor,4,6,8,12 \\
        --host 8,16,none                   # the H200 run
    PYTHONPATH=src python benchmarks/consumer.py --smoke --folder /tmp/flux-smoke \\
        --vram floor,0.01 --host 0.01,none --device cpu    # the plumbing, on the CPU
    PYTHONPATH=src python benchmarks/consumer.py --model wan14b --folder /tmp/wan14b \
        --vram 6 --host 16 --out consumer_wan14b

Writes docs/benchmarks/<--out, default consumer>.{json,md} (under $SHUTTLE_BENCH_OUT when set),
and <--out>.png (seconds per image over the grid, a line per host ceiling, the peers at their
peak VRAM) where matplotlib is installed; ``--plot JSON`` draws it from a run's json alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
import harness  # noqa: E402

ROW_MARK = "CONSUMER-ROW "
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", type=Path, help="where the pipeline is written")
    p.add_argument("--model", choices=list(PIPELINES), default="flux",
                   help="flux: FluxPipeline (Flux-dev); flux-fp8: the same with its transformer's "
                        "linear weights in float8 (an fp8 release; shuttle keeps them float8, "
                        "the resident reference is diffusers' widening load); wan14b: "
                        "WanPipeline (Wan2.1-14B shapes)")
    p.add_argument("--vram", default="floor,4,6,8,12", help="GiB budgets, or 'floor'")
    p.add_argument("--host", default="8,16,none",
                   help="GiB ceilings, or 'none'; a ':lossless' suffix codes what is held")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="peer cells, comma-separated ('' for none): " + ", ".join(PEERS))
    p.add_argument("--peer-scratch", type=Path, default=None,
                   help="where the disk peers write their copy of the weights (default: "
                        "<out>-scratch beside --folder); a disk without room for the folder and "
                        "a copy can use a tmpfs (/dev/shm): the peers then read at RAM speed, "
                        "and their times are lower bounds (each row names its file system)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="denoising steps of each cell's warm-up call (0: the timed call's): "
                        "one step loads and measures what every step does")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="consumer")
    p.add_argument("--rows-from", type=Path, default=None,
                   help="an earlier run's json: its cells not run now are kept (each row names "
                        "the run it came from), so a grid can be completed over several runs "
                        "(its resident row is reused where the folder still holds its output)")
    p.add_argument("--plot", type=Path, default=None, metavar="JSON",
                   help="only draw <--out>.png (seconds per image over the grid) from a run's "
                        "json; needs matplotlib (a grid run draws it too where it is installed)")
    p.add_argument("--worker", nargs=2, metavar=("VRAM", "HOST"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.folder is None and args.plot is None:
        p.error("--folder is required (except with --plot)")
    return args


# -- the peers ----------------------------------------------------------------------------------
# What a user with a small card would run instead, each loading the same folder. Their cells run
# without a host ceiling (none of them takes one); peak RSS says what each needed.


def _diffusers_disk(folder: Path, device: torch.device, scratch: Path):
    """diffusers group offloading, block level, streamed, its offloaded groups on disk."""
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                              offload_type="block_level", num_blocks_per_group=1,
                              use_stream=device.type == "cuda",
                              record_stream=device.type == "cuda",
                              offload_to_disk_path=str(scratch / "diffusers"))
    return pipe


def _accelerate_disk(folder: Path, device: torch.device, scratch: Path):
    """accelerate's disk_offload of every component (weights memory-mapped from its folder)."""
    import accelerate
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            accelerate.disk_offload(module, scratch / "accelerate" / name, execution_device=device)
    return pipe


def _mmgp(profile_no: int):
    def setup(folder: Path, device: torch.device, scratch: Path):
        """mmgp's profile, the transformer and text encoders left in bf16 so outputs compare."""
        import diffusers

        pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
        from mmgp import offload  # after loading: importing it replaces safetensors.safe_open

        offload.profile(pipe, profile_no=profile_no, quantizeTransformer=False,
                        extraModelsToQuantize=[])
        return pipe
    return setup


PEERS = {"diffusers_disk": _diffusers_disk, "accelerate_disk": _accelerate_disk,
         "mmgp4": _mmgp(4), "mmgp5": _mmgp(5)}


def import_classes(folder: Path) -> None:
    """Import the pipeline's and its components' classes (diffusers imports them lazily,
    pulling in most of diffusers and transformers: seconds that any load in a fresh process
    pays, whoever reads the weights), so that a cell's load time is the load's own."""
    import importlib

    index = json.loads((Path(folder) / "model_index.json").read_text())
    getattr(importlib.import_module("diffusers"), index["_class_name"])
    for value in index.values():
        if isinstance(value, list) and len(value) == 2 and value[0] in ("diffusers",
                                                                        "transformers"):
            getattr(importlib.import_module(value[0]), value[1])


def load(args: argparse.Namespace, vram: str, host: str, device: torch.device, row: dict
         ) -> tuple:
    """The cell's pipeline and shuttle's handle (None for the resident and peer cells)."""
    if vram == "resident":
        import diffusers

        return diffusers.DiffusionPipeline.from_pretrained(
            args.folder, torch_dtype=torch.bfloat16).to(device), None
    if vram in PEERS:
        scratch = peer_scratch(args)
        if vram.endswith("_disk"):
            row["peer_scratch_fs"] = file_system(scratch)
        return PEERS[vram](Path(args.folder), device, scratch), None
    from shuttle.integrations import diffusers as sd

    ceiling, kind = host_cell(host)
    folder = compressed_folder(args.folder) if kind == "compressed" else args.folder
    return sd.from_pretrained(folder, torch_dtype=torch.bfloat16, vram_budget=gib(vram),
                              max_host_bytes=ceiling,
                              compress="lossless" if kind == "lossless" else None,
                              device=device)


@contextlib.contextmanager
def load_log(row: dict, keep: int = 24):
    """Puts the first ``keep`` of shuttle's INFO log lines inside the block in
    ``row["load_log"]`` as [seconds since the block began, message] (each component's capture
    ends with one), so that a slow load says where its time went."""
    import logging

    t0 = time.perf_counter()
    lines: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if len(lines) < keep:
                lines.append([round(time.perf_counter() - t0, 3), record.getMessage()[:160]])

    log = logging.getLogger("shuttle")
    handler, level = Keep(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        row["load_log"] = lines


def peer_scratch(args: argparse.Namespace) -> Path:
    """The folder the disk peers write their copy of the weights into (removed after each)."""
    return args.peer_scratch or Path(args.folder).parent / f"{args.out}-scratch"


def file_system(path: Path) -> str:
    """The type of the file system ``path`` is (or would be) on: /proc/mounts' longest
    mount point above it ("unknown" where there is no /proc/mounts)."""
    path = Path(os.path.abspath(path))
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == Path(point) or Path(point) in path.parents) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


# -- the pipelines -------------------------------------------------------------------------------
# Wan2.1-T2V-14B's shapes: the transformer at diffusers' defaults (40 blocks of width 5120, ~28 GB
# in bf16), UMT5-XXL (~11 GB with its 256384-entry table), the Wan VAE. One call: 480x832, 33
# frames (14040 tokens), 2 steps with classifier-free guidance (4 transformer passes).
WAN_CALL = dict(height=480, width=832, frames=33, steps=2, guidance=5.0, max_sequence_length=512)
WAN_CALL_SMOKE = dict(height=64, width=64, frames=5, steps=2, guidance=5.0, max_sequence_length=16)


def wan_configs(smoke: bool) -> dict[str, dict]:
    if smoke:
        return {"transformer": dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64,
                                    num_layers=2, text_dim=32, freq_dim=32),
                "text_encoder": dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                     vocab_size=512, feed_forward_proj="gated-gelu"),
                "vae": dict(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)}
    return {"transformer": {},
            "text_encoder": dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
                                 vocab_size=256384, feed_forward_proj="gated-gelu"),
            "vae": {}}


def build_wan(smoke: bool, pool: torch.Tensor):
    """The WanPipeline, every component on the CPU in bf16 (e2e.py's random weights)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = wan_configs(smoke)
    makers = {"transformer": lambda: WanTransformer3DModel(**cfg["transformer"]),
              "text_encoder": lambda: UMT5EncoderModel(UMT5Config(**cfg["text_encoder"])),
              "vae": lambda: AutoencoderKLWan(**cfg["vae"])}
    parts = {name: e2e.materialize(make, pool, 7_919_993 * k)
             for k, (name, make) in enumerate(makers.items())}
    call = WAN_CALL_SMOKE if smoke else WAN_CALL
    return WanPipeline(tokenizer=e2e.tokenizer(call["max_sequence_length"]),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), **parts)


def wan_call(pipe, device: torch.device, smoke: bool, steps: int | None = None):
    c = WAN_CALL_SMOKE if smoke else WAN_CALL
    if steps is not None:
        c = {**c, "steps": steps}

    def call() -> dict:
        g = torch.Generator(device).manual_seed(0)
        with torch.no_grad():
            frames = pipe(e2e.PROMPT, negative_prompt="blurry", height=c["height"],
                          width=c["width"], num_frames=c["frames"],
                          num_inference_steps=c["steps"], guidance_scale=c["guidance"],
                          max_sequence_length=c["max_sequence_length"], generator=g,
                          output_type="pt").frames
        return {"frames": frames}

    return call


def wan_stats(out: dict) -> dict:
    px = out["frames"].float()
    return {"pixel_mean": px.mean().item(), "pixel_std": px.std().item(),
            "pixels_nan": int(px.isnan().sum())}


def build_flux_fp8(smoke: bool, pool: torch.Tensor):
    """e2e's FluxPipeline with its transformer's linear weights in float8_e4m3fn (rounded to
    nearest), as the fp8 releases of Flux-dev hold them: 12.0 GB of transformer, not 23.8."""
    pipe = e2e.build_flux(smoke, pool)
    with torch.no_grad():
        for m in pipe.transformer.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.data = m.weight.data.to(torch.float8_e4m3fn)
    return pipe


# name -> (build(smoke, pool), call(pipe, device, smoke), stats(out, smoke))
PIPELINES = {
    "flux": (e2e.build_flux, e2e.flux_call,
             lambda out, smoke: e2e.output_stats("flux", out, smoke)),
    "flux-fp8": (build_flux_fp8, e2e.flux_call,
                 lambda out, smoke: e2e.output_stats("flux", out, smoke)),
    "wan14b": (build_wan, wan_call, lambda out, smoke: wan_stats(out)),
}


def gib(text: str) -> int | None:
    return None if text in ("none", "resident") else int(float(text) * GIB)


HOST_KINDS = ("lossless", "compressed")


def host_cell(text: str) -> tuple[int | None, str | None]:
    """A --host cell: (max_host_bytes, kind) of ``8``, ``none``, ``8:lossless``,
    ``8:compressed``."""
    ceiling, _, kind = text.partition(":")
    if kind and kind not in HOST_KINDS:
        raise SystemExit(f"--host {text!r}: the suffix is one of {HOST_KINDS}")
    return gib(ceiling), kind or None


def compressed_folder(folder: Path) -> Path:
    """Where ``folder``'s compressed copy lies (:func:`write_compressed`)."""
    return folder.parent / f"{folder.name}-compressed"


# -- the folder ---------------------------------------------------------------------------------


def write_folder(folder: Path, model: str, smoke: bool) -> int:
    """Write the pipeline once (skipped when ``folder`` holds it); returns its weight bytes."""
    if not (folder / "model_index.json").is_file():
        pipe = PIPELINES[model][0](smoke, e2e.make_pool())
        pipe.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
        del pipe
    return sum(p.stat().st_size for p in folder.glob("*/*.safetensors"))


def write_compressed(folder: Path) -> Path:
    """A copy of the pipeline folder with every weight file written by ``shuttle compress``
    (skipped when it is there): what a user streams with fewer bytes read from disk."""
    from shuttle.weights.lossless_file import compress_folder

    out = compressed_folder(folder)
    if not (out / "model_index.json").is_file():
        for report in compress_folder(folder, out, progress=False):
            print(f"compressed {report.path}: {report.ratio:.3f}x", flush=True)
    return out


def drop_page_cache(folder: Path) -> bool:
    """Evict the folder's files from the page cache (POSIX_FADV_DONTNEED after a sync)."""
    os.sync()
    for path in folder.glob("*/*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def disk_rates(where: Path) -> dict[int, float]:
    """Reads in flight -> bytes per second of the first 4 GiB of ``where`` (a file, or a
    diffusers folder's largest weight file) read as the disk tier reads (O_DIRECT, 8 MiB pieces,
    ``shuttle.offload.disk_reader.read_bandwidth``): one at a time, its pool's 4, and 16 (what
    a deeper queue gets from the same drive)."""
    from shuttle.offload.disk_reader import read_bandwidth

    path = where if where.is_file() else max(where.glob("*/*.safetensors"),
                                             key=lambda p: p.stat().st_size)
    return {w: read_bandwidth(path, 4 * GIB, workers=w) for w in (1, 4, 16)}


def direct_read_bandwidth(where: Path) -> float:
    """The disk's read ceiling in bytes per second: the best of :func:`disk_rates`."""
    return max(disk_rates(where).values())


# -- one cell -------------------------------------------------------------------------------------


def rss_parts() -> dict[str, int]:
    """This process's resident bytes by kind now (``/proc/self/status``: RssAnon, anonymous
    memory such as arenas and Python's heap; RssFile, mapped files such as CUDA's libraries;
    RssShmem), so that a cell over its host ceiling shows what the rest is."""
    parts = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
            name, value = line.split(":")
            parts[name] = int(value.split()[0]) * 1024
    return parts


def read_bytes() -> int:
    """Bytes this process had read from storage (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def worker(args: argparse.Namespace) -> None:
    """Load one cell, warm up, time --runs calls; print its row after ``ROW_MARK``."""
    from shuttle.errors import BudgetTooSmallError

    vram, host = args.worker
    device = torch.device(args.device)
    row: dict = {"vram": vram, "host": host}
    keep = Path(args.folder).parent / f"{args.out}-outputs"
    keep.mkdir(exist_ok=True)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # CUDA's context and libraries, before any weight
    t0 = time.perf_counter()
    import_classes(args.folder)
    row["import_s"] = time.perf_counter() - t0
    # the process before the pipeline (imports, CUDA's context): what the host ceiling excludes
    row["rss_base"] = rss_parts()
    try:
        with e2e.RssSampler() as rss:
            t0 = time.perf_counter()
            with load_log(row):
                pipe, handle = load(args, vram, host, device, row)
            pipe.set_progress_bar_config(disable=True)
            row["load_s"] = time.perf_counter() - t0
            row["rss_after_load"] = {**rss_parts(), "peak": rss.peak}
            call = PIPELINES[args.model][1](pipe, device, args.smoke)
            # warm-up (the first call: at the floor; it measures each module's activations)
            warm = PIPELINES[args.model][1](pipe, device, args.smoke,
                                            steps=args.warmup_steps or None)
            e2e.timed_call(warm, device)
            before = read_bytes()
            walls = []
            with contextlib.ExitStack() as counting:
                copied = [] if handle is None else count_streamed(handle, pipe, counting)
                for _ in range(args.runs):
                    out, wall, _ = e2e.timed_call(call, device)
                    walls.append(wall)
            row["disk_bytes_per_image"] = (read_bytes() - before) / args.runs
            row["s_per_image"] = statistics.median(walls)
            row["image_s"] = walls  # each timed image, in order (the first after the warm-up)
            if device.type == "cuda":
                row["peak_vram"] = torch.cuda.max_memory_allocated(device)
                # what the caching allocator took from the card (allocated plus its cached
                # free blocks): a card of the budget's size must hold this
                row["peak_reserved"] = torch.cuda.max_memory_reserved(device)
            if handle is not None:
                row["device_bytes_per_image"] = sum(copied) / args.runs
                row["host_bytes"] = handle.cache.used_bytes
                # the modules active after a call (those activated ahead of the next call's
                # among them) and the activation bytes each module's plan keeps room for
                row["active_after"] = sorted(n for n, o in handle.offloaders.items() if o.active)
                row["reserves"] = handle.reserves
        row["peak_rss"] = rss.peak
        row["rss_after_calls"] = rss_parts()
        torch.save({k: v.cpu() for k, v in out.items()}, keep / f"{vram}-{host}.pt")
        row["stats"] = PIPELINES[args.model][2](out, args.smoke)
    except BudgetTooSmallError as e:
        row["refused"] = str(e)
        row["floor_bytes"] = vram_floor(str(e))
    print(ROW_MARK + json.dumps(row), flush=True)


def vram_floor(refusal: str) -> int | None:
    """The VRAM floor a ``BudgetTooSmallError`` names (None: it is about the host budget, or
    names none): "give (a budget of) at least N bytes", "floor of ... N bytes", or the size of a
    module that must move whole, "cannot hold 'vae' moved whole (N bytes)"."""
    if not refusal.startswith("vram_budget"):
        return None
    found = (re.search(r"at least (\d+) bytes", refusal)
             or re.search(r"floor of .*?(\d+) bytes", refusal)
             or re.search(r"moved whole \((\d+) bytes\)", refusal))
    return int(found.group(1)) if found else None


def count_streamed(handle, pipe, stack: contextlib.ExitStack) -> list[int]:
    """A list that gets, while ``stack`` is open, the bytes each of ``handle``'s modules
    (``pipe``'s components of those names) copies to the device: at the end of every call what
    its plan streamed in that call (:func:`streamed`), and at every activation what it placed
    (:func:`placed`: a module is activated again after another took its room). An activation
    ahead of a module's call (under the call before it) counts at that call, so that the last
    image's activations for an image not timed are not counted and its first one's are."""
    copied: list[int] = []
    ahead: dict[int, int] = {}  # id(offloader) -> bytes placed ahead of its next call
    for name, off in handle.offloaders.items():
        hook = getattr(pipe, name).register_forward_hook(
            lambda *_, off=off: copied.append(streamed(off)) if off.plan is not None else None)
        stack.callback(hook.remove)

        def activate(*args, off=off, original=off.activate, **kwargs):
            model = original(*args, **kwargs)
            if kwargs.get("wait", True):
                copied.append(placed(off))
            else:
                ahead[id(off)] = placed(off)
            return model

        def ready(off=off, original=off.ready):
            copied.append(ahead.pop(id(off), 0))
            original()

        # instance attributes over the methods, until the stack ends
        off.activate, off.ready = activate, ready
        stack.callback(off.__dict__.pop, "activate", None)
        stack.callback(off.__dict__.pop, "ready", None)
    return copied


def travels(u) -> int:
    """Bytes unit ``u`` copies to the device: coded where its arena or its file holds it coded."""
    code = u.code if u.code is not None else (u.disk_code if u.on_disk else None)
    return code.nbytes if code is not None else u.layout.nbytes


def streamed(off) -> int:
    """Device bytes an active offloader's call copies: each streamed block once."""
    plan = off.plan
    if plan is None:
        return 0
    return sum(travels(u) for g, units in off.storage.groups.items()
               for i, u in enumerate(units) if i not in plan.resident[g])


def placed(off) -> int:
    """Device bytes an activation copies: the non-block weights and the resident blocks (a
    module moved whole: all of it)."""
    plan = off.plan
    s = off.storage
    if plan is None:
        return sum(travels(u) for u in s.units)
    return travels(s.rest) + sum(travels(u) for g, units in s.groups.items()
                                 for i, u in enumerate(units) if i in plan.resident[g])


def run_worker(args: argparse.Namespace, vram: str, host: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", vram, host, "--folder", str(args.folder),
           "--runs", str(args.runs), "--device", args.device, "--out", args.out, "--peers", "",
           "--model", args.model, "--warmup-steps", str(args.warmup_steps)]
    if args.smoke:
        cmd.append("--smoke")
    if args.peer_scratch is not None:
        cmd += ["--peer-scratch", str(args.peer_scratch)]
    # on the CPU, through the copy path (slots and hooks as on CUDA), so that the plumbing runs
    env = {**os.environ, "SHUTTLE_OFFLOAD_CPU_COPY": "1"} if args.device == "cpu" else None
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(ROW_MARK):
            return json.loads(line[len(ROW_MARK):])
    return {"vram": vram, "host": host, "error": (proc.stderr or proc.stdout)[-2000:]}


# -- the grid ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.plot is not None:
        plot(json.loads(args.plot.read_text())["rows"], harness.OUT_DIR / f"{args.out}.png",
             TITLES[args.model])
        return
    weights = write_folder(args.folder, args.model, args.smoke)
    if any(host_cell(h)[1] == "compressed" for h in args.host.split(",")):
        write_compressed(args.folder)
    env = harness.environment()
    # bytes per second (e2e.pinned_bandwidth gives GB/s), measured before any worker runs
    pinned = e2e.pinned_bandwidth() * 1e9 if args.device == "cuda" else None
    rates = disk_rates(args.folder)
    env["disk_bytes_per_s_by_reads_in_flight"] = rates
    direct = max(rates.values())
    rows: list[dict] = []
    earlier = earlier_rows(args)
    keep = args.folder.parent / f"{args.out}-outputs"
    resident = [r for r in earlier if r["vram"] == "resident" and "s_per_image" in r]
    if resident and (keep / "resident-none.pt").is_file():
        compute = resident[0]["s_per_image"]  # a grid completed over several runs of one folder
    else:
        record(args, rows, run_worker(args, "resident", "none"), env, weights, pinned, direct,
               earlier)
        compute = rows[0].get("s_per_image")
    want = torch.load(keep / "resident-none.pt") if (keep / "resident-none.pt").is_file() else None
    for vram in filter(None, args.vram.split(",")):
        for host in args.host.split(","):
            drop_page_cache(args.folder)
            if host_cell(host)[1] == "compressed":
                drop_page_cache(compressed_folder(args.folder))
            row = (run_floor(args, host, floor_hint([*earlier, *rows], host)) if vram == "floor"
                   else run_worker(args, vram, host))
            path = keep / f"{row['vram']}-{host}.pt"  # a floor cell: the budget it ran at
            if want is not None and path.is_file():
                row["bit_identical"] = e2e.same_bits(torch.load(path), want)
            if "s_per_image" in row:
                terms = [compute or 0.0, row.get("device_bytes_per_image", 0) / pinned
                         if pinned else 0.0, row["disk_bytes_per_image"] / direct]
                row["bound_s"] = max(terms)
                row["of_bound"] = row["s_per_image"] / row["bound_s"] if row["bound_s"] else None
            record(args, rows, row, env, weights, pinned, direct, earlier)
    for peer in filter(None, args.peers.split(",")):
        drop_page_cache(args.folder)
        row = run_worker(args, peer, "none")
        # a peer's disk copy of the weights (diffusers' groups, accelerate's folder) goes
        # before the next peer writes its own: the device's disk holds the folder and one copy
        shutil.rmtree(peer_scratch(args), ignore_errors=True)
        path = keep / f"{peer}-none.pt"
        if want is not None and path.is_file():
            row["bit_identical"] = e2e.same_bits(torch.load(path), want)
        record(args, rows, row, env, weights, pinned, direct, earlier)
    try:
        plot(json.loads((harness.OUT_DIR / f"{args.out}.json").read_text())["rows"],
             harness.OUT_DIR / f"{args.out}.png", TITLES[args.model])
    except ImportError:
        print("no plot: matplotlib is not installed (draw it later with --plot JSON)")


def floor_hint(rows: list[dict], host: str) -> int | None:
    """The highest floor (bytes) a finished floor cell of ``host``'s kind (plain, lossless,
    compressed) ran at, or None: where the next such cell's search starts. The weights and
    activations on the device do not depend on the host ceiling, so this saves the searching
    workers (a load and a first call each, half a minute to a minute at real size); a cell
    whose own floor is lower runs at most 2% above the hint's."""
    kind = host_cell(host)[1]
    floors = [float(r["vram"]) * GIB / 1.02 for r in rows
              if r.get("floor_tries") and "s_per_image" in r and host_cell(r["host"])[1] == kind]
    return int(max(floors)) if floors else None


def run_floor(args: argparse.Namespace, host: str, hint: int | None = None,
              tries: int = 3) -> dict:
    """The cell at the smallest VRAM budget that runs with ``host``: 2% above the floor a budget
    of 1 GiB (1 MB with --smoke) is told, or above ``hint`` (:func:`floor_hint`), raised to the
    floor a refusal names when a call's measured activations do not fit beside the weights
    (each kind of host cell has its own floor: coded units need staging on the device)."""
    first = f"{hint * 1.02 / GIB:.6f}" if hint else "0.001" if args.smoke else "1"
    row = run_worker(args, first, host)
    if hint:
        row["floor_tries"] = 1
    for _ in range(tries):
        floor = row.get("floor_bytes")
        if not floor:
            return row
        tried = row
        drop_page_cache(args.folder)
        row = run_worker(args, f"{floor * 1.02 / GIB:.6f}", host)
        row["floor_tries"] = tried.get("floor_tries", 0) + 1
        if row.get("floor_bytes") is not None and row["floor_bytes"] <= floor:
            return row  # refused at a floor already given: no progress
    return row


def earlier_rows(args: argparse.Namespace) -> list[dict]:
    """The rows of ``--rows-from`` (each with the run it came from), or none."""
    if args.rows_from is None:
        return []
    data = json.loads(args.rows_from.read_text())
    return [{**r, "run": r.get("run") or {k: data["env"].get(k) for k in RUN_KEYS}}
            for r in data["rows"]]


RUN_KEYS = ("date", "device", "commit")  # what names the run a row came from


def record(args: argparse.Namespace, rows: list[dict], row: dict, env: dict, weights: int,
           pinned: float | None, direct: float, earlier: list[dict] = ()) -> None:
    """Add ``row`` and rewrite the results (a run cut short keeps every finished cell), with
    the ``earlier`` rows of cells this run has not (re)run.
    """
    if "load_s" in row:  # against one plain read of the folder's files at the O_DIRECT rate
        row["load_over_read"] = row["load_s"] / (weights / direct)
    row["run"] = {k: env.get(k) for k in RUN_KEYS}
    rows.append(row)
    print(json.dumps(row), flush=True)
    done = {(r["vram"], r["host"]) for r in rows}
    kept = [r for r in earlier if (r["vram"], r["host"]) not in done]
    runs = {json.dumps(r["run"], sort_keys=True) for r in [*kept, *rows]}
    notes = ("" if len(runs) == 1 else
             "Rows from several runs (the json names each row's): " + "; ".join(
                 ", ".join(str(v) for v in json.loads(r).values()) for r in sorted(runs)) + ".")
    payload = {"env": env, "weights": weights, "pinned_bytes_per_s": pinned,
               "direct_bytes_per_s": direct, "rows": [*kept, *rows]}
    harness.write_results(args.out, payload, table([*kept, *rows]), "Consumer budgets", notes)


HOST_STYLES = {"8": ("o", "tab:blue"), "16": ("s", "tab:green"), "none": ("^", "tab:gray"),
               "8:lossless": ("D", "tab:purple"), "8:compressed": ("P", "tab:red")}
PEER_STYLES = {"mmgp4": ("v", "tab:orange"), "mmgp5": ("<", "tab:orange"),
               "diffusers_disk": ("X", "tab:brown"), "accelerate_disk": ("*", "tab:olive")}


TITLES = {"flux": "FluxPipeline (Flux-dev), 1024x1024, 4 steps, weights on disk",
          "flux-fp8": "FluxPipeline (Flux-dev, fp8 transformer), 1024x1024, 4 steps, weights "
                      "on disk",
          "wan14b": "WanPipeline (Wan2.1-14B shapes), 480x832, 33 frames, weights on disk"}


def plot(rows: list[dict], path: Path, title: str = TITLES["flux"]) -> None:
    """Seconds per image (log) over the VRAM budget, a line per host ceiling; each peer a
    marker at its measured peak VRAM; the resident pipeline a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    ran = [r for r in rows if r.get("s_per_image")]
    for r in ran:
        if r["vram"] == "resident":
            vram = f" ({r['peak_vram'] / GIB:.0f} GiB VRAM)" if r.get("peak_vram") else ""
            ax.axhline(r["s_per_image"], color="black", linestyle="--", linewidth=1,
                       label=f"resident{vram}")
    hosts = dict.fromkeys(r["host"] for r in ran if r["vram"] not in ("resident", *PEERS))
    for host in hosts:
        cells = sorted((float(r["vram"]), r["s_per_image"]) for r in ran
                       if r["host"] == host and r["vram"] not in ("resident", *PEERS))
        marker, color = HOST_STYLES.get(host, ("x", None))
        label = "no host ceiling" if host == "none" else f"host {host.replace(':', ' GiB, ')}" \
            + ("" if ":" in host else " GiB")
        ax.plot(*zip(*cells, strict=True), marker=marker, color=color, label=label)
    for r in ran:
        if r["vram"] in PEERS and r.get("peak_vram"):
            marker, color = PEER_STYLES.get(r["vram"], ("x", None))
            ax.scatter(r["peak_vram"] / GIB, r["s_per_image"], marker=marker, color=color,
                       s=70, zorder=3, label=f"{r['vram']} (at its peak VRAM"
                       + (f"; its copy on {fs}" if (fs := r.get("peer_scratch_fs")) else "") + ")")
    harness.time_axes(ax, "VRAM budget (GiB; peers: their peak)", "seconds per image (log)",
                      title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the points
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    def f(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = ["VRAM", "host", "s/image", "of bound", "peak VRAM GiB", "peak RSS GiB",
            "RSS at start GiB", "disk GB/image", "load s", "load / read", "bit-identical"]
    body = [[r["vram"], r["host"] + (f" (its copy on {r['peer_scratch_fs']})"
                                     if r.get("peer_scratch_fs") else ""),
             f(r.get("s_per_image"), ".2f"), f(r.get("of_bound"), ".2f"),
             f(r.get("peak_vram") and r["peak_vram"] / GIB, ".2f"),
             f(r.get("peak_rss") and r["peak_rss"] / GIB, ".2f"),
             f(r.get("rss_base") and sum(r["rss_base"].values()) / GIB, ".2f"),
             f(r.get("disk_bytes_per_image") and r["disk_bytes_per_image"] / 1e9, ".2f"),
             f(r.get("load_s"), ".1f"), f(r.get("load_over_read"), ".2f"),
             r["bit_identical"] if "bit_identical" in r else
             (r.get("refused") or r.get("error", "-").strip().splitlines()[-1])[:80]]
            for r in rows]
    return harness.markdown_table(head, body)


if __name__ == "__main__":
    main()
