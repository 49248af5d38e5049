"""The per-module hook of a dynamic adapter: the update added at forward time, weights untouched.

Low-rank patches on a Linear run in one of these tiers (x: (..., K), down_i: (r_i, K),
up_i: (N, r_i), s_i = strength_i * alpha_i / r_i * request scale):

    exact     out = base(x); per adapter d = x @ down_i.T @ up_i.T, then d * (alpha/r), d * m,
              d * request (each skipped when it is 1: x * 1.0 is exact), d rounded to out's
              dtype once, out = out + d. The chain runs in torch.promote_types of x's dtype
              and the factors' (cast to it): bf16 x with bf16 factors stays the bf16 chain
              PEFT computes; an fp16 file on a float32 or bf16 layer runs in float32 (never
              x cast to fp16: past 65504 that is inf). Bit-identical to that reference chain;
              scales are Python floats.
    lossless  h = x @ down.T over all adapters' ranks concatenated (R = sum r_i), h *= s
              per rank column (float32), then out.addmm_(h, up.T) onto the base output.
              The factors are stored at attach in the layer's compute dtype promoted by the
              file's (a float32 file: float32 GEMMs; a bf16 file on an fp16 layer: float32),
              except that an fp16 file on a bf16 layer is rounded to bf16, which holds fp16's
              range (float32 GEMMs would more than double the update's cost). x is never cast
              to a narrower dtype, here or in the fused and tensor-parallel forwards.
              On CUDA with at most 64 tokens (decode) one kernel does all of it in float32
              (shuttle.kernels.lora_decode): launches, not bytes, are the cost there.
    fused     S = (x @ down.T) * s in float32 (one kernel), then one kernel whose float32
              accumulator runs over x @ W.T and S @ up.T, adds the bias and writes out once
              (the CuTe-DSL Hopper GEMM where it runs, which can compute S itself, else
              Triton's). At most 64 tokens: a split-K shrink, then lora_decode_linear.
    auto      each call by lossless or a fused form, whichever measured fastest for the
              layer's shape and device (:mod:`shuttle.apply.tier`).

Low-rank patches on Conv and Embedding layers go through the patch's own residual (its conv or
lookup), in the dtype the tier would use on a Linear (exact: the promotion of the input's, or an
Embedding weight's, dtype and the factors'; lossless: the same, but an fp16 file on a bf16 layer
in bf16), scaled there and rounded to the output's dtype once. A patch runs as factors when its
kind gives a low-rank form (:meth:`shuttle.patches.PatchKind.lowrank`). Every other patch
(LoHa, LoKr, diffs, norms, set, (IA)3, DoRA) and every other module is applied as a float32 weight
residual ``R = patch(W) - W`` computed once per attach (and again when a strength changes): the
forward uses ``W + request * R``, rounded to the weight's dtype once, so the activations meet
only a weight of the layer's own dtype whatever the file's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

from shuttle.apply.layer_kind import chain_dtype, layer_kind
from shuttle.apply.plan import Contribution, logical_spec
from shuttle.apply.scale import prepare_request_scale, request_scale, request_scale_value
from shuttle.apply.scale_vector import ScaleVector, capture_state
from shuttle.apply.strength import Strengths
from shuttle.apply.tensor_parallel import TensorParallelUpdate
from shuttle.apply.tier import TIERS, TierKey, row_bucket
from shuttle.errors import UnsupportedLayerError, UnsupportedPlacementError
from shuttle.hooks import ModuleHook, substituted
from shuttle.kernels import interpreting, lora_linear_fused, lora_shrink, triton_available
from shuttle.kernels.lora_decode import DECODE_MAX_T, PreparedLoraDecode
from shuttle.kernels.lora_gemm_sm90 import CUTE_SHRINK_MAX_RANK
from shuttle.kernels.lora_linear_cute import cute_available
from shuttle.kernels.lora_linear_tma import PreparedLoraLinear
from shuttle.patches import PATCH_KINDS, LowRank, Patch
from shuttle.weights import FP8_DTYPES
from shuttle.weights.dtensor import is_dtensor
from shuttle.weights.plain import is_plain_tensor

__all__ = ["LoRAHook", "Quality"]

Quality = Literal["exact", "lossless", "fused", "auto"]


@dataclasses.dataclass
class _Slot:
    """One adapter's low-rank patch on this module."""

    adapter: int
    patch: LowRank
    rows: tuple[int, int] | None
    columns: tuple[int, int]  # its ranks in the concatenated factors


class _Residual(NamedTuple):
    """One adapter's patch in a weight residual, applied at its attachment's strength."""

    adapter: int
    patch: Patch
    rows: tuple[int, int] | None


class LoRAHook(ModuleHook):
    """Adds the active adapters' updates to one module's forward.

    Args:
        name: the module's name in the model (for messages).
        module: the module.
        contribs: parameter leaf name -> its contributions.
        strengths: the attachment's strengths (its values, their generation, its followers,
            its device tensors), indexed by ``adapter``.
        quality: the tier for low-rank patches on Linear layers.
        pad_rank: pad each adapter's rank to this (so a later adapter of rank <= it can be
            swapped in without a recompile).
    """

    def __init__(self, name: str, module: torch.nn.Module,
                 contribs: dict[str, list[Contribution]], strengths: Strengths,
                 quality: Quality, pad_rank: int | None = None):
        self.name = name
        self.quality = quality
        self.allow_cute, self.cute_form = True, "fused_cute"  # may CuTe run; "fused"'s CuTe form
        # the "auto" picks: (the chooser's generation, {(row bucket, graphs, x's dtype): pick})
        self._picks: tuple[int, dict[tuple, str]] = (-1, {})
        self._last: tuple[tuple | None, str] = (None, "lossless")  # (call's key, its pick)
        self._strengths = strengths
        self.scales = ScaleVector(strengths)  # the Linear tiers' per-rank-column scale
        self.layer = layer_kind(module)
        # A quantized layer's output can come from a custom autograd Function, which forbids
        # in-place updates of it: the residual is then added out of place.
        self.in_place = is_plain_tensor(getattr(module, "weight", None))
        self.sharded = is_dtensor(getattr(module, "weight", None))
        self.slots: list[_Slot] = []
        # the weight-residual patches, without the plan's strengths: those are self._strengths'
        self.dense: dict[str, list[_Residual]] = {}
        for leaf, cs in contribs.items():
            for c in cs:
                # the patch's kind says whether it runs as low-rank factors beside the layer
                lowrank = PATCH_KINDS[c.patch.kind].lowrank(c.patch) if leaf == "weight" \
                    else None
                if lowrank is not None and self.layer.takes(module, lowrank) \
                        and (self.layer.tiers or not self.sharded):
                    if c.rows is not None and not self.layer.tiers:
                        raise UnsupportedLayerError(
                            f"{name}: a low-rank patch on rows {c.rows} of a "
                            f"{type(module).__name__} cannot run dynamically; use mode='merge'"
                        )
                    self.slots.append(_Slot(c.adapter, lowrank, c.rows, (0, 0)))
                elif self.sharded or is_dtensor(getattr(module, leaf)):
                    raise UnsupportedPlacementError(
                        f"{name}.{leaf}: a DTensor-sharded {type(module).__name__} runs "
                        f"dynamic adapters for low-rank patches on Linear layers only, not a "
                        f"{c.patch.kind} patch here; merge it (mode='merge') instead")
                elif not is_plain_tensor(getattr(module, leaf)):
                    # The residual path overrides the weight with W + R: a quantized layer's
                    # forward cannot take a float weight, so only low-rank residuals run here.
                    raise UnsupportedLayerError(
                        f"{name}.{leaf}: a {c.patch.kind} patch cannot run dynamically over a "
                        f"quantized {type(module).__name__} weight (only low-rank patches on "
                        "Linear layers can); merge it with mode='merge' instead"
                    )
                else:
                    self.dense.setdefault(leaf, []).append(_Residual(c.adapter, c.patch, c.rows))
        self._build_lowrank(module, pad_rank)
        self._tensor_parallel = TensorParallelUpdate(name)  # a DTensor layer's update
        self.residuals: dict[str, torch.Tensor] = {}
        self.refresh(module)
        # Create the shared scale and strength tensors now: created inside a compiled forward,
        # they would change a guarded dict and cost a recompile on the next call.
        for p in module.parameters(recurse=False):
            prepare_request_scale(p.device)
            strengths.tensor(p.device)

    # -- building --------------------------------------------------------------------------
    def _build_lowrank(self, module: torch.nn.Module, pad_rank: int | None) -> None:
        """Concatenate the Linear slots' factors: down (R, K), up (N, R) zero outside rows."""
        self.down = self.up = self._decode = None  # (the decode kernels for down and up)
        self.scales.base_scale = self.scales.col_adapter = None
        self._prepared: dict[str, PreparedLoraLinear] = {}  # per fused implementation
        if not self.layer.tiers or not self.slots:
            return
        w = module.weight
        spec = logical_spec(w)  # a quantized weight: its logical shape and compute dtype
        dtypes = {t.dtype for s in self.slots for t in (s.patch.up, s.patch.down)}
        # The factors are kept in the layer's compute dtype (a float8 weight's is bfloat16: it
        # computes cast up, see weights.upcast_on_use) promoted by the file's: a float32
        # adapter keeps float32 GEMMs, an fp16 one on a float32 layer is widened; an fp16 one
        # on a bf16 layer is rounded to bf16 (see layer_kind.chain_dtype), a bf16 one on an
        # fp16 layer kept in float32 (fp16 cannot hold bf16's range).
        wdtype = torch.bfloat16 if spec.dtype in FP8_DTYPES else spec.dtype
        fdtype = chain_dtype(wdtype, *sorted(dtypes, key=str), exact=False)
        widths = [max(s.patch.rank, pad_rank or 0) for s in self.slots]
        total = sum(widths)
        self.down = torch.zeros(total, spec.shape[1], dtype=fdtype, device=w.device)
        self.up = torch.zeros(spec.shape[0], total, dtype=fdtype, device=w.device)
        self.scales.base_scale = torch.zeros(total, dtype=torch.float32, device=w.device)
        self.scales.col_adapter = torch.zeros(total, dtype=torch.long, device=w.device)
        start = 0
        for slot, width in zip(self.slots, widths, strict=True):
            self._place(slot, start, width)
            start += width
        self._decode = PreparedLoraDecode(self.down, self.up)

    def _place(self, slot: _Slot, start: int, width: int) -> None:
        up, down = slot.patch.factors()
        r = down.shape[0]
        r0, r1 = slot.rows or (0, self.up.shape[0])
        self.down[start:start + width].zero_()
        self.up[:, start:start + width].zero_()
        self.down[start:start + r] = down
        self.up[r0:r1, start:start + r] = up
        self.scales.base_scale[start:start + width] = slot.patch.effective_scale
        self.scales.col_adapter[start:start + width] = slot.adapter
        slot.columns = (start, start + width)

    def to_device(self, device: torch.device) -> None:
        """Move the hook's own tensors (factors, scales, residuals) to ``device``.

        For a hook built against host weights that compute elsewhere (an offloaded quantized
        layer, whose storage tensors land on the device only while active).
        """
        for owner, attr in ((self, "down"), (self, "up"), (self.scales, "base_scale"),
                            (self.scales, "col_adapter")):
            t = getattr(owner, attr)
            if t is not None:
                setattr(owner, attr, t.to(device))
        self._prepared = {}
        self._decode = PreparedLoraDecode(self.down, self.up) if self.down is not None else None
        self._picks, self._last = (-1, {}), (None, "lossless")  # picks are per device
        self.residuals = {k: r.to(device) for k, r in self.residuals.items()}
        self.scales.moved()
        prepare_request_scale(device)
        self._strengths.tensor(device)

    def refresh(self, module: torch.nn.Module) -> None:
        """Recompute the float32 weight residuals from the current strengths.

        An adapter at strength 0 is off, as in a merge (which drops it): its patches are
        skipped, whatever their kind does at 0 (a DoRA still renormalizes W, a set gives 0).
        """
        self.residuals = {}
        for leaf, cs in self.dense.items():
            cs = [c for c in cs if self._strengths[c.adapter] != 0]
            if not cs:
                continue
            w = getattr(module, leaf).detach().float()
            out = w.clone()
            for c in cs:  # in the plan's order, as a merge applies them
                view = out if c.rows is None else out[c.rows[0]:c.rows[1]]
                view.copy_(c.patch.apply(view, self._strengths[c.adapter]))
            self.residuals[leaf] = out.sub_(w)
        self.scales.stale()

    # -- forward ---------------------------------------------------------------------------
    def _overrides(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        if not self.residuals:
            return {}
        req = request_scale(module.weight.device if hasattr(module, "weight") else
                            next(iter(self.residuals.values())).device)
        out = {}
        for leaf, r in self.residuals.items():
            p = getattr(module, leaf)
            out[leaf] = (p.float() + r * req).to(p.dtype)
        return out

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        # FSDP2 swaps its gathered, plain weights in for the forward: those take the plain path
        if self.sharded and is_dtensor(module.weight):
            out = inner(*args, **kwargs)
            return self._tensor_parallel(module, args[0], out, self.down, self.up,
                                         self.scales(self.down.device)) if self.slots else out
        overrides = self._overrides(module)
        x = args[0] if args else None
        capturing = None  # whether a CUDA graph is being captured, once asked (see ScaleVector)
        if self.layer.tiers and self.slots and self.quality in ("fused", "auto") and \
                x is not None:
            impl, capturing = self._implementation(module, x, overrides, inner, args, kwargs)
            if impl != "lossless":
                return self._fused(module, x, overrides, impl, capturing)
        if overrides:
            with substituted(module, overrides):
                out = inner(*args, **kwargs)
        else:
            out = inner(*args, **kwargs)
        if not self.slots:
            return out
        if self.layer.tiers:
            return (self._exact(x, out) if self.quality == "exact"
                    else self._lossless(x, out, capturing))
        return self._residuals(module, x, out)

    def _implementation(self, module: torch.nn.Module, x: torch.Tensor,
                        overrides: dict[str, torch.Tensor], inner: Callable[..., Any],
                        args: tuple, kwargs: dict) -> tuple[str, bool | None]:
        """This call's implementation (``"fused"``: CuTe's where it applies, else Triton's;
        ``"auto"``: the measured fastest, lossless where nothing can be measured), and whether a
        CUDA graph is being captured where that was asked (else None). A pick is kept per (row
        bucket, graphs, x's dtype).
        """
        if self.quality == "fused":
            return ("lossless" if not self._fused_ok(module, x)
                    else self.cute_form if self._cute_ok(module, x) else "fused"), None
        if torch.compiler.is_compiling():
            return "lossless", None
        graphs = x.is_cuda and torch.cuda.is_current_stream_capturing()
        # The last call's pick when this one has its shape (a loop calls each layer with one
        # shape). This runs before the base GEMM is issued: a last pick of lossless stands
        # without the other checks, each of which picks lossless too.
        call = (TIERS.generation, x.shape, graphs, x.dtype)
        last, pick = self._last
        if (call == last and pick == "lossless") or overrides or (torch.is_grad_enabled() and (
                x.requires_grad or module.weight.requires_grad
                or getattr(module.bias, "requires_grad", False))):
            return "lossless", graphs
        if call != last:
            pick = self._pick(module, x, overrides, inner, args, kwargs, graphs, call)
        return pick, graphs

    def _pick(self, module: torch.nn.Module, x: torch.Tensor,
              overrides: dict[str, torch.Tensor], inner: Callable[..., Any], args: tuple,
              kwargs: dict, graphs: bool, call: tuple) -> str:
        """The "auto" pick for ``x``'s row bucket: kept per bucket, else measured; a pick
        kept is also remembered for ``call`` (the next call of the same shape).
        """
        at = (row_bucket(x.numel() // x.shape[-1]), graphs, x.dtype)
        if self._picks[0] == TIERS.generation:
            pick = self._picks[1].get(at)
            if pick is not None:
                self._last = (call, pick)
                return pick
        else:
            self._picks = (TIERS.generation, {})
        if x.device.type not in TIERS.devices or not self._fused_ok(module, x):
            self._picks[1][at], self._last = "lossless", (call, "lossless")
            return "lossless"
        cute = self._cute_ok(module, x)
        key = TierKey(str(x.device), x.dtype, at[0], module.weight.shape[0], x.shape[-1],
                      self.down.shape[0], getattr(module, "bias", None) is not None)
        pick = TIERS.known(key, graphs=graphs)
        if pick is None:
            if graphs:  # nothing can be timed during a capture
                return "lossless"
            candidates: dict[str, Callable[[], object]] = {
                "lossless": lambda: self._lossless(x, inner(*args, **kwargs)),
                "fused": lambda: self._fused(module, x, overrides, "fused")}
            if cute:
                # the one-kernel form (last) takes ranks up to CUTE_SHRINK_MAX_RANK
                forms = ("fused_cute", "fused_cute_pingpong", "fused_cute_shrink")
                for f in forms[:3 if self.down.shape[0] <= CUTE_SHRINK_MAX_RANK else 2]:
                    candidates[f] = lambda f=f: self._fused(module, x, overrides, f)
            with torch.no_grad():
                pick = TIERS.choose(key, candidates)
        if pick.startswith("fused_cute") and not cute:  # measured on a layer that could
            pick = "fused"
        self._picks[1][at], self._last = pick, (call, pick)
        return pick

    def _cute_ok(self, module: torch.nn.Module, x: torch.Tensor) -> bool:
        """Whether the CuTe kernel can take this call (the extra on an sm_90 device, more rows
        than the decode kernels take, the factors in the layer's dtype).
        """
        return (self.allow_cute and x.is_cuda and x.numel() > DECODE_MAX_T * x.shape[-1]
                and x.dtype == self.down.dtype == self.up.dtype
                and cute_available(x.get_device()))

    def _exact(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        req = request_scale_value()
        for slot in self.slots:
            up, down = slot.patch.factors()
            # The chain's dtype is never narrower than x's: an fp16 file on a float32 or bf16
            # layer runs in float32 (x cast to fp16 would overflow past 65504 and lose bits).
            cd = chain_dtype(x.dtype, down.dtype, up.dtype)
            d = x.to(cd) @ down.to(cd).T @ up.to(cd).T
            if slot.patch.effective_scale != 1:
                d = d * slot.patch.effective_scale
            if self._strengths[slot.adapter] != 1:
                d = d * self._strengths[slot.adapter]
            if req != 1:
                d = d * req
            d = d.to(out.dtype)
            if slot.rows is None:
                out = out + d
            else:
                r0, r1 = slot.rows
                out = torch.cat([out[..., :r0], out[..., r0:r1] + d, out[..., r1:]], dim=-1)
        return out

    def _lossless(self, x: torch.Tensor, out: torch.Tensor, capturing: bool | None = None
                  ) -> torch.Tensor:
        device = x.device
        capturing = capture_state(device) if capturing is None else capturing  # asked once
        scale = self.scales(device, capturing)
        if (x.is_cuda and self.in_place and out.is_contiguous()
                and x.numel() <= DECODE_MAX_T * x.shape[-1]
                and x.dtype == out.dtype == self.down.dtype == self.up.dtype):
            # A few tokens (decode): the whole update in one launch, h kept in float32.
            return self._decode.add(out, x, scale, capturing)
        down, up = self.down, self.up
        if x.dtype != down.dtype:  # x is never narrowed to the stored factors' dtype
            cd = chain_dtype(x.dtype, down.dtype)
            if cd != down.dtype:  # x wider than the layer's dtype (a quantized layer's input)
                down, up = down.to(cd), up.to(cd)
            x = x.to(cd)
        h = F.linear(x, down)
        # h * scale computed in float32 and rounded once, in place (one kernel: type promotion
        # computes a bf16 * fp32 product in fp32).
        h = h.mul_(scale)
        if up.dtype != out.dtype or not out.is_contiguous() or not self.in_place:
            return out + F.linear(h, up).to(out.dtype)
        out2d = out.view(-1, out.shape[-1])
        out2d.addmm_(h.reshape(-1, h.shape[-1]), up.T)
        return out

    def _fused_ok(self, module: torch.nn.Module, x: torch.Tensor | None) -> bool:
        if x is None or not (x.is_cuda or interpreting()) or not triton_available():
            return False
        # The fused kernel reads W itself: a quantized weight takes its own forward instead.
        w = module.weight
        return (is_plain_tensor(w) and x.dtype == w.dtype
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32))

    def _fused(self, module: torch.nn.Linear, x: torch.Tensor,
               overrides: dict[str, torch.Tensor], impl: str = "fused",
               capturing: bool | None = None) -> torch.Tensor:
        """The update by the fused implementation ``impl`` (CuTe's fall back to Triton's)."""
        weight, bias = module.weight, module.bias
        w, b = overrides.get("weight", weight), overrides.get("bias", bias)
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        # x with strided features (a transposed residual stream) copied once here, not per kernel
        x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
        scale = self.scales(x.device, capturing)
        if x2d.shape[0] <= DECODE_MAX_T and x.dtype == self.down.dtype == self.up.dtype:
            # A few tokens (decode): a split-K shrink, then one kernel for the base, the update
            # and the bias, bound by reading W (shuttle.kernels.lora_decode).
            out = self._decode.linear(x2d, w, b, scale)
        else:
            out = None
            if w is weight and b is bias:  # no per-call residual overrides
                # The Hopper path, the layer's operands checked once (the functions: per call)
                prep = self._prepared.get(impl)
                if prep is None or not prep.fits(w, b):
                    prep = PreparedLoraLinear(w, b, self.down, self.up, impl)
                    self._prepared[impl] = prep
                if prep.usable:
                    out = prep(x2d, scale)
            if out is None:
                # Triton's kernels (S keeps float32 math for float32 factors)
                out = lora_linear_fused(x2d, w, b, lora_shrink(x2d, self.down, scale), self.up)
        return out if x2d is x else out.view(*x.shape[:-1], w.shape[0])

    def _residuals(self, module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor
                   ) -> torch.Tensor:
        """Conv / Embedding low-rank residuals through the patch's own op."""
        exact = self.quality == "exact"
        req = request_scale_value() if exact else request_scale(out.device)
        # an Embedding's input holds indices: its chain starts from the weight's dtype
        layer = x.dtype if x.is_floating_point() else module.weight.dtype
        for slot in self.slots:
            dtype = chain_dtype(layer, *(t.dtype for _, t in slot.patch.tensors()), exact=exact)
            r = slot.patch.residual(x, module, dtype)
            m = self._strengths[slot.adapter] if exact else \
                self._strengths.tensor(out.device)[slot.adapter]
            out = out + (r * (m * req)).to(out.dtype)  # scaled in the chain's dtype, rounded once
        return out

    # -- swapping --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device | None:
        """Where the hook's low-rank factors live (None: no Linear factors, patches as given)."""
        return None if self.down is None else self.down.device

    def check_swap(self, module: torch.nn.Module, adapter: int, rows: tuple[int, int] | None,
                   patch: LowRank) -> None:
        """Raise unless ``patch`` can replace ``adapter``'s slot on ``rows`` of ``module`` (the
        hook's module; nothing changes).

        Raises:
            UnsupportedLayerError: a patch this layer would run otherwise (a Tucker core on a
                Linear), or a rank above the slot's width.
        """
        where = f"{self.name}" + (f" rows {rows}" if rows is not None else "")
        slot = next((s for s in self.slots if s.adapter == adapter and s.rows == rows), None)
        assert slot is not None, f"{where}: adapter {adapter} has no slot here"
        if not self.layer.takes(module, patch):
            raise UnsupportedLayerError(
                f"{where}: the new adapter's low-rank patch (shapes {patch.shapes()}) does not "
                f"run through this {self.layer.name} layer's factor slots; detach() and attach the "
                "new adapter instead"
            )
        width = slot.columns[1] - slot.columns[0]
        if self.layer.tiers and patch.rank > width:
            raise UnsupportedLayerError(
                f"{where}: the new adapter has rank {patch.rank} but the slot holds {width}; "
                f"attach with max_rank >= {patch.rank} to allow swapping"
            )

    def swap(self, adapter: int, patches: dict[tuple[int, int] | None, LowRank]) -> None:
        """Give each of ``adapter``'s slots (keyed by its rows) its new patch.

        Linear factors are copied into the slot's columns in place (no new tensors, so compiled
        graphs keep running); Conv and Embedding slots keep the patch itself. Call
        :meth:`check_swap` for every patch first: this changes the slots as it goes.
        """
        slots = {s.rows: s for s in self.slots if s.adapter == adapter}
        assert set(slots) == set(patches), f"{self.name}: swap of other row ranges than held"
        for rows, patch in patches.items():
            slot = slots[rows]
            slot.patch = patch
            if self.layer.tiers:
                self._place(slot, slot.columns[0], slot.columns[1] - slot.columns[0])
        self.scales.stale()
