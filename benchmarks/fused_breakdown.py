"""Where the fused dynamic tier's GPU time goes, and the tile sweeps behind its defaults.

An experiment, not a product path. ``k_exp`` is a copy of the fused TMA kernel
(``shuttle.kernels.lora_linear_tma``) whose MODE places the rank loop after the K loop (0, as
shipped), before it (1), inside it behind a branch on the step (2), or drops it (3: the base
GEMM alone); FLAT toggles the persistent loop's flattening; INT_ROUND stores bf16 by integer
rounding (the interpreter's spelling) instead of the hardware conversion. Also the shrink's TMA
and plain tile sweeps, ``lora_decode_linear``'s decode sweep, and (group ``cute``, with the
``hopper`` extra) the CuTe-DSL GEMM per tile against cuBLAS's base and Triton's fused kernel,
with a rank-8 run standing in for its base GEMM alone.

Every variant is captured in a CUDA graph and replayed (GPU time alone), interleaved with
cuBLAS's base linear; the fused variants' outputs are checked against float32 math first.
Writes docs/benchmarks/fused_breakdown.{json,md} (fused_breakdown_<group>.* for one group).

    python benchmarks/fused_breakdown.py [large] [decode] [inline] [waves] [cute]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from shuttle.kernels import lora_decode as LD  # noqa: E402
from shuttle.kernels import lora_linear as LL  # noqa: E402
from shuttle.kernels import lora_linear_tma as LT  # noqa: E402
from shuttle.kernels.lora_shrink import lora_shrink  # noqa: E402
from shuttle.kernels.tma import ensure_allocator  # noqa: E402

LARGE = {"wan1.3b_attn": (32760, 1536, 1536, 128), "zimage_attn": (4352, 3840, 3840, 32),
         "wan1.3b_ffn_up": (32760, 1536, 8960, 128)}
INLINE = {**LARGE, "prefill_mlp": (8192, 4096, 14336, 16)}
# The demo DiT's linears (benchmarks/dynamic_lora.py's whole-model run): 4096 tokens, rank 64.
WAVES = {"dit_qkv": (4096, 1536, 4608, 64), "dit_proj": (4096, 1536, 1536, 64),
         "dit_fc1": (4096, 1536, 6144, 64), "dit_fc2": (4096, 6144, 1536, 64)}
DECODE = {"decode_qkv": (16, 4096, 6144, 16), "decode_1_token": (1, 4096, 6144, 16),
          "decode_mlp": (16, 4096, 14336, 16)}


@triton.jit
def k_exp(x_ptr, w_ptr, s_ptr, u_ptr, o_ptr, bias_ptr, T, N, K, R, stride_xt, stride_wn,
          stride_st, stride_un, stride_ot, N_PROGS: tl.constexpr, BT: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr,
          MODE: tl.constexpr, FLAT: tl.constexpr, STAGES: tl.constexpr,
          INT_ROUND: tl.constexpr):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[stride_xt, 1],
                                       block_shape=[BT, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                       block_shape=[BN, BK])
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[T, N], strides=[stride_ot, 1],
                                       block_shape=[BT, BN])
    s_desc = tl.make_tensor_descriptor(s_ptr, shape=[T, R], strides=[stride_st, 1],
                                       block_shape=[BT, BR])
    u_desc = tl.make_tensor_descriptor(u_ptr, shape=[N, R], strides=[stride_un, 1],
                                       block_shape=[BN, BR])
    grid_t = tl.cdiv(T, BT)
    grid_n = tl.cdiv(N, BN)
    in_group = GROUP * grid_n
    k_steps = tl.cdiv(K, BK)
    r_steps = tl.cdiv(R, BR)
    for tile in tl.range(tl.program_id(0), grid_t * grid_n, N_PROGS, flatten=FLAT,
                         num_stages=STAGES):
        first_t = (tile // in_group) * GROUP
        group_t = tl.minimum(grid_t - first_t, GROUP)
        ot = (first_t + (tile % in_group) % group_t) * BT
        on = ((tile % in_group) // group_t) * BN
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        if MODE == 0:  # K loop, then the rank loop (as shipped)
            for k in range(0, k_steps):
                acc = tl.dot(x_desc.load([ot, k * BK]), w_desc.load([on, k * BK]).T, acc)
            for r in range(0, r_steps):
                acc = tl.dot(s_desc.load([ot, r * BR]), u_desc.load([on, r * BR]).T, acc)
        elif MODE == 1:  # the rank loop first
            for r in range(0, r_steps):
                acc = tl.dot(s_desc.load([ot, r * BR]), u_desc.load([on, r * BR]).T, acc)
            for k in range(0, k_steps):
                acc = tl.dot(x_desc.load([ot, k * BK]), w_desc.load([on, k * BK]).T, acc)
        elif MODE == 2:  # one loop over K and rank steps, a branch on the step (BR == BK)
            for k in range(0, k_steps + r_steps):
                if k < k_steps:
                    a = x_desc.load([ot, k * BK])
                    b = w_desc.load([on, k * BK])
                else:
                    a = s_desc.load([ot, (k - k_steps) * BK])
                    b = u_desc.load([on, (k - k_steps) * BK])
                acc = tl.dot(a, b.T, acc)
        else:  # the base GEMM alone
            for k in range(0, k_steps):
                acc = tl.dot(x_desc.load([ot, k * BK]), w_desc.load([on, k * BK]).T, acc)
        rn = on + tl.arange(0, BN)
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if INT_ROUND:
            bits = acc.to(tl.uint32, bitcast=True)
            bits += ((bits >> 16) & 1) + 0x7FFF
            o_desc.store([ot, on], (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))
        else:
            o_desc.store([ot, on], acc.to(tl.bfloat16))


@triton.jit
def k_inline(x_ptr, w_ptr, d_ptr, u_ptr, scale_ptr, o_ptr, bias_ptr, T, N, K, R,
             stride_xt, stride_wn, stride_dr, stride_un, stride_ot,
             N_PROGS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             BR: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr,
             FLAT: tl.constexpr):
    # Work unit: one row block (BT rows) x CHUNK column tiles. The unit first computes its
    # rows' S = (x @ D.T) * scale (BT, BR) in float32, rounds it, keeps it in registers, then
    # each column tile: acc = x @ W.T over K, acc += S @ U.T, + bias, store.
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[stride_xt, 1],
                                       block_shape=[BT, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                       block_shape=[BN, BK])
    d_desc = tl.make_tensor_descriptor(d_ptr, shape=[R, K], strides=[stride_dr, 1],
                                       block_shape=[BR, BK])
    u_desc = tl.make_tensor_descriptor(u_ptr, shape=[N, R], strides=[stride_un, 1],
                                       block_shape=[BN, BR])
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[T, N], strides=[stride_ot, 1],
                                       block_shape=[BT, BN])
    grid_t = tl.cdiv(T, BT)
    grid_n = tl.cdiv(N, BN)
    chunks = tl.cdiv(grid_n, CHUNK)
    k_steps = tl.cdiv(K, BK)
    rr = tl.arange(0, BR)
    scale = tl.load(scale_ptr + rr, mask=rr < R, other=0.0)
    for unit in range(tl.program_id(0), grid_t * chunks, N_PROGS):
        ot = (unit % grid_t) * BT
        n0 = (unit // grid_t) * CHUNK
        sacc = tl.zeros((BT, BR), dtype=tl.float32)
        for k in tl.range(0, k_steps, num_stages=STAGES):
            a = x_desc.load([ot, k * BK])
            d = d_desc.load([0, k * BK])
            if IEEE:
                sacc = tl.dot(a.to(tl.float32), d.to(tl.float32).T, sacc, input_precision="ieee")
            else:
                sacc = tl.dot(a, d.T, sacc)
        s = (sacc * scale[None, :]).to(x_ptr.dtype.element_ty)
        n_end = tl.minimum(n0 + CHUNK, grid_n)
        for n in tl.range(n0, n_end, flatten=FLAT, num_stages=STAGES):
            on = n * BN
            acc = tl.zeros((BT, BN), dtype=tl.float32)
            for k in range(0, k_steps):
                a = x_desc.load([ot, k * BK])
                b = w_desc.load([on, k * BK])
                if IEEE:
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b.T, acc)
            ub = u_desc.load([on, 0])
            if IEEE:
                acc = tl.dot(s.to(tl.float32), ub.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(s, ub.T, acc)
            rn = on + tl.arange(0, BN)
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            o_desc.store([ot, on], acc.to(o_ptr.dtype.element_ty))


def run_exp(x, w, s, u, b, out, mode, flat=True, stages=3, int_round=False, bt=128, bn=256,
            bk=64, br=64, group=8, warps=8):
    t, k = x.shape
    n = w.shape[0]
    progs = min(triton.cdiv(t, bt) * triton.cdiv(n, bn),
                torch.cuda.get_device_properties().multi_processor_count)
    ensure_allocator()
    k_exp[(progs,)](x, w, s, u, out, b, t, n, k, s.shape[1], x.stride(0), w.stride(0),
                    s.stride(0), u.stride(0), out.stride(0), N_PROGS=progs, BT=bt, BN=bn,
                    BK=bk, BR=br, GROUP=group, MODE=mode, FLAT=flat, STAGES=stages,
                    INT_ROUND=int_round, num_warps=warps)


def graph_times(variants: dict, rounds: int) -> dict[str, float]:
    """Median ms of each variant's graph replay, interleaved; variants that fail are reported."""
    graphs = {}
    for name, fn in variants.items():
        try:
            graphs[name] = harness.graphed(fn)
        except Exception as e:  # noqa: BLE001 - an experiment: record and go on
            print(f"{name}: failed: {str(e)[:200]}", flush=True)
    timings = harness.interleaved({q: (lambda i, g=g: g.replay()) for q, g in graphs.items()},
                                  rounds=rounds, warmup=3)
    return {q: v["median_ms"] for q, v in timings.items()}


def operands(t, k, n, r):
    """x (T, K), W (N, K), bias, A (R, K), B (N, R) in bf16 and a float32 (R,) scale, seeded."""
    torch.manual_seed(0)
    x = torch.randn(t, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda").bfloat16()
    a = (torch.randn(r, k, device="cuda") / k**0.5).bfloat16()
    u = (torch.randn(n, r, device="cuda") * 0.02).bfloat16()
    return x, w, b, a, u, torch.full((r,), 0.4, device="cuda")


def large(t, k, n, r, rounds):
    x, w, b, a, u, scale = operands(t, k, n, r)
    s = lora_shrink(x, a, scale)
    out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    br = min(64, r)
    v = {"base cuBLAS": lambda: F.linear(x, w, b),
         "fused (shipped)": lambda: LL.lora_linear_fused(x, w, b, s, u)}
    names = {0: "rank loop after K", 1: "rank loop first", 2: "one loop, branch", 3: "base only"}
    for mode, label in names.items():
        for flat in (True, False):
            v[f"{label}, flatten={flat}"] = (
                lambda m=mode, f=flat: run_exp(x, w, s, u, b, out, m, f, br=br))
    v["rank loop after K, integer rounding"] = (
        lambda: run_exp(x, w, s, u, b, out, 0, int_round=True, br=br))
    v["base only, integer rounding"] = lambda: run_exp(x, w, s, u, b, out, 3, int_round=True)
    v["rank loop after K, 4 stages, BK 32"] = (
        lambda: run_exp(x, w, s, u, b, out, 0, stages=4, bk=32, br=min(32, r)))
    v["rank loop after K, group 16"] = lambda: run_exp(x, w, s, u, b, out, 0, group=16, br=br)
    v["shrink cuBLAS + scale"] = lambda: F.linear(x, a).mul_(scale)
    v["shrink (shipped)"] = lambda: lora_shrink(x, a, scale)
    v["shrink plain kernel"] = lambda: lora_shrink(x, a, scale, tma=False)
    for cfg in [(64, 128, 64, 64, 8, 4, 4), (128, 128, 64, 64, 8, 4, 4),
                (128, 128, 128, 64, 8, 4, 3), (256, 128, 64, 64, 8, 8, 3)]:
        v[f"shrink TMA {cfg[:3]} w{cfg[5]} s{cfg[6]}"] = (
            lambda c=cfg: LT.linear_tma(x, a, None, None, None, scale, s, LL.FusedConfig(*c)))
    for cfg in [(64, 128, 64, 4, 4, 0), (64, 128, 128, 4, 3, 0), (32, 128, 128, 4, 4, 0)]:
        v[f"shrink plain {cfg[:3]} s{cfg[4]}"] = (
            lambda c=cfg: lora_shrink(x, a, scale, config=c, tma=False))
    ref = x.float() @ w.float().T + s.float() @ u.float().T + b.float()
    errors = {}
    with torch.no_grad():
        for name, fn in v.items():
            if "rank loop" in name or "branch" in name:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - e.g. the branch needs rank steps == K
                    errors[name] = f"failed: {str(e)[:120]}"  # steps; recorded, run goes on
                    continue
                errors[name] = float((out.float() - ref).abs().max())
        return graph_times(v, rounds), errors


def run_inline(x, w, a, u, scale, b, out, bt=128, bn=256, bk=64, chunk=0, stages=3, warps=8,
               flat=True):
    t, k = x.shape
    n, r = u.shape
    grid_n = triton.cdiv(n, bn)
    chunk = chunk or grid_n
    units = triton.cdiv(t, bt) * triton.cdiv(grid_n, chunk)
    progs = min(units, torch.cuda.get_device_properties().multi_processor_count)
    ensure_allocator()
    k_inline[(progs,)](x, w, a, u, scale, out, b, t, n, k, r, x.stride(0), w.stride(0),
                       a.stride(0), u.stride(0), out.stride(0), N_PROGS=progs, BT=bt, BN=bn,
                       BK=bk, BR=max(16, triton.next_power_of_2(r)), CHUNK=chunk,
                       STAGES=stages, IEEE=False, FLAT=flat, num_warps=warps)


def inline(t, k, n, r, rounds):
    """The shrink inside the GEMM: each persistent program computes its rows' S once."""
    x, w, b, a, u, scale = operands(t, k, n, r)
    out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    v = {"base cuBLAS": lambda: F.linear(x, w, b),
         "shrink + fused (shipped)": lambda: LL.lora_linear_fused(x, w, b,
                                                                  lora_shrink(x, a, scale), u),
         "base only (TMA)": lambda: run_exp(x, w, x, w, b, out, 3)}
    grid_n = triton.cdiv(n, 256)
    for c in [0] + [c for c in (6, 12) if c < grid_n]:
        v[f"inline 128x256 chunk {c or 'all'}"] = (
            lambda c=c: run_inline(x, w, a, u, scale, b, out, chunk=c))
    v["inline 128x256 chunk all, no flatten"] = lambda: run_inline(x, w, a, u, scale, b, out,
                                                                   flat=False)
    v["inline 128x128 chunk all"] = lambda: run_inline(x, w, a, u, scale, b, out, bn=128)
    v["inline 64x256 w4 chunk all"] = lambda: run_inline(x, w, a, u, scale, b, out, bt=64,
                                                         warps=4)
    v["inline 128x256 bk128 s2"] = lambda: run_inline(x, w, a, u, scale, b, out, bk=128,
                                                      stages=2)
    s = lora_shrink(x, a, scale)
    ref = x.float() @ w.float().T + s.float() @ u.float().T + b.float()
    errors = {}
    with torch.no_grad():
        for name, fn in v.items():
            if name.startswith("inline"):
                try:
                    out.zero_()
                    fn()
                except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                    errors[name] = f"failed: {str(e)[:200]}"
                    continue
                errors[name] = float((out.float() - ref).abs().max())
        return graph_times(v, rounds), errors


def waves(t, k, n, r, rounds):
    """Fused tile shapes at a few thousand rows, where 128 x 256 tiles fill the SMs unevenly."""
    x, w, b, a, u, scale = operands(t, k, n, r)
    s = lora_shrink(x, a, scale)

    def lossless():
        out = F.linear(x, w, b)
        return out.addmm_(F.linear(x, a).mul_(scale).to(x.dtype), u.T)

    v = {"base cuBLAS": lambda: F.linear(x, w, b), "lossless (cuBLAS chain)": lossless,
         "shrink + fused (shipped)": lambda: LL.lora_linear_fused(x, w, b,
                                                                  lora_shrink(x, a, scale), u),
         "shrink (shipped)": lambda: lora_shrink(x, a, scale),
         "shrink plain kernel (split-K)": lambda: lora_shrink(x, a, scale, tma=False),
         "shrink cuBLAS + scale": lambda: F.linear(x, a).mul_(scale)}
    for cfg in [(128, 256, 64, 64, 8, 8, 3), (128, 128, 64, 64, 8, 4, 4),
                (128, 128, 64, 64, 8, 8, 4), (64, 256, 64, 64, 8, 4, 3),
                (128, 128, 128, 64, 8, 8, 3)]:
        v[f"fused {cfg[:3]} w{cfg[5]} s{cfg[6]}"] = (
            lambda c=cfg: LL.lora_linear_fused(x, w, b, s, u, config=c, tma=True))
    for cfg in [(64, 128, 128, 64, 8, 4, 4), (128, 64, 128, 64, 8, 4, 4),
                (64, 64, 128, 64, 8, 4, 4)]:
        v[f"shrink TMA {cfg[:3]} w{cfg[5]} s{cfg[6]}"] = (
            lambda c=cfg: LT.linear_tma(x, a, None, None, None, scale, s.clone(),
                                        LL.FusedConfig(*c)))
    ref = x.float() @ w.float().T + s.float() @ u.float().T + b.float()
    errors = {}
    with torch.no_grad():
        for name, fn in v.items():
            if name.startswith("fused"):
                try:
                    errors[name] = float((fn().float() - ref).abs().max())
                except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                    errors[name] = f"failed: {str(e)[:200]}"
        return graph_times(v, rounds), errors


def decode(t, k, n, r, rounds):
    x, w, b, a, u, scale = operands(t, k, n, r)
    v = {"base cuBLAS": lambda: F.linear(x, w, b),
         "decode linear (shipped)": lambda: LD.lora_decode_linear(x, w, b, a, u, scale)}
    v["shrink + small-T fused kernel"] = (
        lambda: LL.lora_linear_fused(x, w, b, lora_shrink(x, a, scale), u))
    # (The committed decode results also hold shrink_k 0 rows: the one-launch form, since
    # dropped from lora_decode_linear as slower.)
    for cfg in [(32, 128, 4, 3, 256),
                (64, 128, 4, 3, 256), (32, 128, 4, 3, 512), (32, 256, 4, 3, 256),
                (32, 128, 4, 4, 256), (16, 256, 4, 3, 256), (32, 128, 8, 3, 256)]:
        v[f"decode linear {cfg}"] = lambda c=cfg: LD.lora_decode_linear(x, w, b, a, u, scale,
                                                                        config=c)
    got = LD.lora_decode_linear(x, w, b, a, u, scale)
    want = LD.lora_decode_linear_reference(x, w, b, a, u, scale)
    with torch.no_grad():
        return graph_times(v, rounds), {"elements != reference": int((got != want).sum())}


def cute(t, k, n, r, rounds):
    from shuttle.kernels.cute_dsl import CUTE_TILES
    from shuttle.kernels.lora_linear_cute import CuteLoraGemm

    x, w, b, a, u, scale = operands(t, k, n, r)
    s = lora_shrink(x, a, scale)
    out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    s8, u8 = s[:, :8].contiguous(), u[:, :8].contiguous()
    v = {"base cuBLAS": lambda: F.linear(x, w, b),
         "fused Triton (shipped)": lambda: LL.lora_linear_fused(x, w, b, s, u)}
    gemms = {}
    for tile in CUTE_TILES:
        label = f"CuTe {tile.m}x{tile.n}"
        gemms[label] = CuteLoraGemm(w, u, True, tile)
        gemms[f"{label}, rank 8 (~ its base GEMM)"] = CuteLoraGemm(w, u8, True, tile)
        v[label] = lambda g=gemms[label]: g(x, w, b, s, out)
        v[f"{label}, rank 8 (~ its base GEMM)"] = (
            lambda g=gemms[f"{label}, rank 8 (~ its base GEMM)"]: g(x, w, b, s8, out))
    ref = x.float() @ w.float().T + s.float() @ u.float().T + b.float()
    errors = {}
    with torch.no_grad():
        for name, g in gemms.items():
            if "rank 8" not in name:
                g(x, w, b, s, out)
                errors[name] = float((out.float() - ref).abs().max())
        return graph_times(v, rounds), errors


def main() -> None:
    harness.spin_up(2)
    results, rows = {}, []
    only = sys.argv[1:]  # e.g. "decode": that group alone
    groups = {"large": (LARGE, large, 15), "decode": (DECODE, decode, 30),
              "inline": (INLINE, inline, 15), "waves": (WAVES, waves, 20),
              "cute": ({**INLINE, **WAVES}, cute, 15)}
    for shapes, fn, rounds in (g for name, g in groups.items()
                               if name in only or (not only and name in ("large", "decode"))):
        for name, shape in shapes.items():
            times, checks = fn(*shape, rounds)
            results[name] = {"shape": shape, "ms": times, "checks": checks}
            base = times["base cuBLAS"]
            for q, ms in times.items():
                rows.append([name, q, f"{ms * 1e3:.1f}", f"{100 * (ms - base) / base:+.1f}%"])
            print(f"{name} {shape} done", flush=True)
    table = harness.markdown_table(["shape", "variant", "µs (graph)", "vs cuBLAS base"], rows)
    harness.write_results("_".join(["fused_breakdown", *only]), results, table,
                          "Fused tier breakdown and tile sweeps (benchmarks/fused_breakdown.py"
                          + (f" {' '.join(only)})" if only else ")"),
                          "Each variant captured in a CUDA graph and replayed, interleaved; "
                          "medians. Shapes (T, K, N, rank) as in dynamic_lora.py.")
    print(table)


if __name__ == "__main__":
    main()
