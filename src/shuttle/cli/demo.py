"""``shuttle demo``: the whole adapter path on a small DiT-like model, checked against float64,
then the memory path (:mod:`shuttle.cli.demo_streaming`): a model larger than its budgets
streamed from its file with an adapter, checked against the resident model.

It builds a model (fused qkv attention, MLP, norms, a patch-embedding conv), writes adapters in
four tools' spellings with hand-made factors (PEFT directory, kohya LoRA/LoCon, LyCORIS LoHa/LoKr,
ComfyUI diff/set), loads them back, merges them one at a time, all at once and scoped, and
compares every weight with the same update computed independently in float64 and rounded once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.cli.args import device_arg
from shuttle.cli.demo_streaming import run_streaming
from shuttle.cli.table import render_table

# A reference update: (parameter name, rows or None, W64 -> new W64).
Update = tuple[str, "tuple[int, int] | None", Callable[[torch.Tensor], torch.Tensor]]


class DemoBlock(nn.Module):
    """Pre-norm transformer block with a fused qkv projection."""

    def __init__(self, dim: int, mlp: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.to_qkv = nn.Linear(dim, 3 * dim)
        self.attn.proj = nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, mlp)
        self.mlp.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, dim]
        h = self.norm(x)
        q, k, v = self.attn.to_qkv(h).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        x = x + self.attn.proj(a)
        return x + self.mlp.fc2(torch.nn.functional.gelu(self.mlp.fc1(self.norm(x))))


class DemoDiT(nn.Module):
    """Patch-embedding conv, a few blocks, a final projection."""

    def __init__(self, channels: int = 4, dim: int = 64, mlp: int = 256, depth: int = 2):
        super().__init__()
        self.patch_embed = nn.Conv2d(channels, dim, kernel_size=2, stride=2)
        self.blocks = nn.ModuleList(DemoBlock(dim, mlp) for _ in range(depth))
        self.final = nn.Linear(dim, channels * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, H, W]
        h = self.patch_embed(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            h = block(h)
        return self.final(h)


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: D103
    p = sub.add_parser("demo", help="merge adapters of four formats exactly; stream a model "
                                    "larger than its budgets")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cuda or cpu (default: cuda when present)")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def _randn(*shape: int, g: torch.Generator, scale: float = 0.05) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _write_adapters(model: DemoDiT, root: Path, g: torch.Generator) -> dict[str, tuple]:
    """Write four adapters; return name -> (source path, strength, reference updates)."""
    dim = model.blocks[0].attn.proj.in_features
    mlp = model.blocks[0].mlp.fc1.out_features
    out: dict[str, tuple] = {}

    def lowrank(param: str, rows, up, down, s: float, m: float) -> Update:
        return (param, rows, lambda w: w + m * s * (up.double().flatten(1) @
                                                    down.double().flatten(1)).reshape(w.shape))

    # 1. PEFT directory: q/k/v LoRAs onto the fused to_qkv rows, rank_pattern for fc2.
    m, r, alpha = 0.8, 8, 16.0
    tensors, updates = {}, []
    for i, _ in enumerate(model.blocks):
        for j, name in enumerate(("to_q", "to_k", "to_v")):
            a, b = _randn(r, dim, g=g), _randn(dim, r, g=g)
            key = f"base_model.model.blocks.{i}.attn.{name}"
            tensors |= {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}
            updates.append(lowrank(f"blocks.{i}.attn.to_qkv.weight", (j * dim, (j + 1) * dim),
                                   b, a, alpha / r, m))
        a, b = _randn(4, mlp, g=g), _randn(dim, 4, g=g)
        key = f"base_model.model.blocks.{i}.mlp.fc2"
        tensors |= {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}
        updates.append(lowrank(f"blocks.{i}.mlp.fc2.weight", None, b, a, alpha / 4, m))
    peft_dir = root / "peft"
    peft_dir.mkdir()
    save_file(tensors, str(peft_dir / "adapter_model.safetensors"))
    (peft_dir / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "rank_pattern": {"fc2": 4}}))
    out["peft"] = (peft_dir, m, updates)

    # 2. kohya: LoRA on fc1 with alpha tensors, LoCon on the patch-embedding conv.
    m, tensors, updates = 1.0, {}, []
    for i, _ in enumerate(model.blocks):
        down, up = _randn(8, dim, g=g), _randn(mlp, 8, g=g)
        key = f"lora_unet_blocks_{i}_mlp_fc1"
        tensors |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                    f"{key}.alpha": torch.tensor(4.0)}
        updates.append(lowrank(f"blocks.{i}.mlp.fc1.weight", None, up, down, 4.0 / 8, m))
    conv = model.patch_embed
    down, up = _randn(4, conv.in_channels, 2, 2, g=g), _randn(conv.out_channels, 4, 1, 1, g=g)
    tensors |= {"lora_unet_patch_embed.lora_down.weight": down,
                "lora_unet_patch_embed.lora_up.weight": up}
    updates.append(lowrank("patch_embed.weight", None, up, down, 1.0, m))
    save_file(tensors, str(root / "kohya.safetensors"))
    out["kohya"] = (root / "kohya.safetensors", m, updates)

    # 3. LyCORIS: LoHa on attn.proj, LoKr on the final projection.
    m, tensors, updates = 0.6, {}, []
    for i, _ in enumerate(model.blocks):
        w = [_randn(dim, 4, g=g, scale=0.3), _randn(4, dim, g=g, scale=0.3),
             _randn(dim, 4, g=g, scale=0.3), _randn(4, dim, g=g, scale=0.3)]
        key = f"lycoris_blocks_{i}_attn_proj"
        tensors |= {f"{key}.hada_{n}": t for n, t in zip(("w1_a", "w1_b", "w2_a", "w2_b"), w,
                                                         strict=True)}
        tensors[f"{key}.alpha"] = torch.tensor(2.0)
        w64 = [t.double() for t in w]
        updates.append((f"blocks.{i}.attn.proj.weight", None, lambda W, w64=w64, m=m:
                        W + m * 0.5 * (w64[0] @ w64[1]) * (w64[2] @ w64[3])))
    out_f = model.final.out_features
    w1, w2a, w2b = _randn(4, 4, g=g, scale=0.5), _randn(out_f // 4, 2, g=g, scale=0.5), \
        _randn(2, dim // 4, g=g, scale=0.5)
    tensors |= {"lycoris_final.lokr_w1": w1, "lycoris_final.lokr_w2_a": w2a,
                "lycoris_final.lokr_w2_b": w2b, "lycoris_final.alpha": torch.tensor(1.0)}
    updates.append(("final.weight", None, lambda W, m=m: W + m * 0.5 * torch.kron(
        w1.double(), w2a.double() @ w2b.double())))
    save_file(tensors, str(root / "lycoris.safetensors"))
    out["lycoris"] = (root / "lycoris.safetensors", m, updates)

    # 4. ComfyUI dense payloads: norm weight/bias diffs, a replaced final bias.
    m, tensors, updates = 0.5, {}, []
    for i in range(len(model.blocks)):
        dw, db = _randn(dim, g=g), _randn(dim, g=g)
        key = f"diffusion_model.blocks.{i}.norm"
        tensors |= {f"{key}.diff": dw, f"{key}.diff_b": db}
        updates.append((f"blocks.{i}.norm.weight", None, lambda W, d=dw, m=m: W + m * d.double()))
        updates.append((f"blocks.{i}.norm.bias", None, lambda W, d=db, m=m: W + m * d.double()))
    value = _randn(out_f, g=g, scale=1.0)
    tensors["diffusion_model.final.bias.set_weight"] = value
    updates.append(("final.bias", None, lambda W, m=m: m * value.double().expand_as(W)))
    save_file(tensors, str(root / "comfy.safetensors"))
    out["comfy"] = (root / "comfy.safetensors", m, updates)
    return out


def _reference(base: dict[str, torch.Tensor], updates: list[Update]) -> dict[str, torch.Tensor]:
    """Every update in float64, one rounding to the weight's dtype at the end."""
    w64 = {n: t.double() for n, t in base.items()}
    for name, rows, fn in updates:
        view = w64[name] if rows is None else w64[name][rows[0]:rows[1]]
        view.copy_(fn(view.clone()))
    return {n: w64[n].to(base[n].dtype) for n in base}


def _compare(model: nn.Module, ref: dict[str, torch.Tensor], base: dict[str, torch.Tensor]):
    """(elements differing from ``ref``, max error in ulps of the weight dtype, changed params).

    A difference of one ulp can occur where the float32 sum and the float64 sum fall on either
    side of a rounding boundary.
    """
    exact = total = changed = 0
    worst = 0.0
    for name, p in model.named_parameters():
        got, want = p.detach().cpu(), ref[name]
        exact += int((got == want).sum())
        total += got.numel()
        changed += int(not torch.equal(got, base[name]))
        # one unit in the last place of the reference value, in the weight's dtype
        spacing = (torch.nextafter(want, torch.full_like(want, torch.inf)).double()
                   - want.double()).abs()
        worst = max(worst, float(((got.double() - want.double()).abs() / spacing).max()))
    return f"{total - exact} of {total:,}", worst, changed


def run(args: argparse.Namespace) -> int:  # noqa: D103
    device = str(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = DemoDiT().to(device=device, dtype=torch.bfloat16)
    base = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _write_adapters(model, Path(tmp), g)
        loras = {name: (shuttle.load_lora(src), m, upd) for name, (src, m, upd) in
                 adapters.items()}

        def restore() -> None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(base[n])

        for name, (lora, m, updates) in loras.items():
            t0 = time.perf_counter()
            report = shuttle.merge_lora(model, [(lora, m)])
            ms = (time.perf_counter() - t0) * 1e3
            frac, ulp, changed = _compare(model, _reference(base, updates), base)
            results.append([f"merge {name}", lora.format, len(lora), len(report.applied),
                            len(report.unmatched), frac, f"{ulp:.2f}", f"{ms:.1f}"])
            restore()
        pairs = [(lora, m) for lora, m, _ in loras.values()]
        all_updates = [u for _, _, upd in loras.values() for u in upd]
        ref = _reference(base, all_updates)
        report = shuttle.merge_lora(model, pairs)
        frac, ulp, _ = _compare(model, ref, base)
        results.append(["merge all 4 at once", "mixed", sum(len(lora) for lora, _ in pairs),
                        len(report.applied), len(report.unmatched), frac, f"{ulp:.2f}",
                        "-"])
        restore()
        x = torch.randn(2, 4, 16, 16, device=device, dtype=torch.bfloat16)
        with shuttle.apply_lora(model, pairs) as report:
            frac, ulp, _ = _compare(model, ref, base)
            y = model(x)
        restored = all(torch.equal(p.detach().cpu(), base[n]) for n, p in model.named_parameters())
        results.append(["apply_lora (scoped)", "mixed", "-", len(report.applied),
                        len(report.unmatched), frac, f"{ulp:.2f}",
                        f"restored bit-exact: {restored}"])
    headers = ["scenario", "format", "modules", "params changed", "unmatched",
               "differ from float64 ref", "max err (ulp)", "ms / note"]
    merged_ok = restored and bool(torch.isfinite(y).all()) and all(
        float(r[6]) <= 1.0 and r[4] == 0 for r in results)
    streaming, streamed_ok = run_streaming(device, DemoDiT, g)
    ok = merged_ok and streamed_ok
    if args.json:
        print(json.dumps({"device": device, "ok": ok, "rows": [dict(zip(headers, r, strict=True))
                                                                for r in results],
                          "streaming": streaming, "streaming_ok": streamed_ok}, indent=2))
    else:
        print(f"shuttle demo on {device} (bfloat16 DiT-like model, "
              f"{sum(p.numel() for p in model.parameters()):,} parameters)\n")
        print(render_table(headers, results))
        print("\nEvery merged weight is compared with the same update computed in float64 and "
              "rounded once;\nmax err is in units of bfloat16 spacing (<= 1: within one rounding).")
        print(f"\nStreaming on {device}: a model five times its VRAM budget, captured from its "
              "safetensors file\nunder a host ceiling below half its size (the rest read from "
              "disk), a kohya LoRA merged as\neach block lands, against the resident model with "
              "the same merge:\n")
        print(render_table(list(streaming), [list(streaming.values())]))
        print(f"\nresult: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1
