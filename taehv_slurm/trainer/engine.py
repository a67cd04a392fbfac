"""Data parallelism behind one small interface: one flat all-reduce per step, or DeepSpeed ZeRO stage 1,
2 or 3.

    engine.train_step(microbatches, lr) → StepMetrics of one optimizer step (gradient accumulation inside)
    engine.evaluate(frames, teacher_latents) → metrics without gradients
    engine.full_state() / engine.load_full_state(state) → the engine-independent state

One optimizer step's gradient is the mean over exactly `batch.effective` samples however they are split
over ranks and micro-batches: each micro-batch's mean loss is weighted by its share of the step's
samples (`Microbatch.weight` = its samples / effective batch) and the ranks' gradients are summed. So a
rank with one sample more than another counts it, and the update equals the one-device update up to
floating-point summation order.

`train_step` never waits for the GPU: its metrics stay on the device (sums over this rank's samples) and
the trainer turns them into numbers once per log line. That matters for CUDA graphs too: a graph's
outputs are overwritten by its next replay, so each micro-step's metrics are added into a tensor of our
own before the next micro-batch runs.

The state is full tensors by parameter name: fp32 weights, AdamW's two moments and its step count.
Every engine writes and reads the same layout, so a run saved under ZeRO-3 on 16 GPUs resumes with
allreduce on 8 (no ZeRO-2 → 3 conversion). The student has ~11 M parameters, so the full
state is ~135 MB and gathering it for a save takes well under a second.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from taehv_slurm.common.config import ConfigError, missing_engine_package
from taehv_slurm.common.plan import COMPILED_ENGINES
from taehv_slurm.trainer.layers import FAST_PATHS
from taehv_slurm.trainer.losses import DistillModule, summarize
from taehv_slurm.trainer.precompile import PrecompiledForward, precompiled_folder
from taehv_slurm.trainer.stragglers import StepClock
from taehv_slurm.trainer.teacher import to_unit


class Microbatch(NamedTuple):
    frames: torch.Tensor  # uint8 N×T×3×H×W on the device
    latents: torch.Tensor | None  # teacher latents, or None
    weight: float  # samples / effective batch; 0 for a padding micro-batch (see ScalePlan.microbatch_sizes)


@dataclass
class StepMetrics:
    """One optimizer step's metrics on this rank, still on the device (no host sync)."""

    names: tuple[str, ...]
    sums: torch.Tensor  # float64, per name: the metric summed over this rank's samples of the step
    samples: int  # this rank's samples in the step (padding excluded)
    grad_norm: torch.Tensor  # global gradient norm before clipping (the same on every rank)
    skipped: torch.Tensor  # bool: the update was not applied (non-finite loss or norm; same on every rank)

    def means(self) -> dict[str, float]:
        """This rank's per-sample means (syncs with the device)."""
        values = (self.sums / max(1, self.samples)).tolist()
        return {**dict(zip(self.names, values)), "grad_norm": float(self.grad_norm)}


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class _MetricSums:
    """Σ over samples of each metric of one step, added micro-batch by micro-batch on the device."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.sums: torch.Tensor | None = None
        self.samples = 0

    def add(self, metrics: dict[str, torch.Tensor], batch_size: int, weight: float) -> None:
        if weight == 0:
            return  # a padding micro-batch: trained with weight 0, counted nowhere
        if not self.names:
            self.names = tuple(metrics)
        # One stack per micro-batch, read before the next replay can overwrite a CUDA graph's outputs.
        vec = torch.stack([metrics[k].detach().to(torch.float64) for k in self.names]) * batch_size
        self.sums = vec if self.sums is None else self.sums + vec
        self.samples += batch_size

    def result(self, grad_norm: torch.Tensor, skipped: torch.Tensor) -> StepMetrics:
        if self.sums is None:
            raise ValueError("train_step got no micro-batch with samples")
        return StepMetrics(self.names, self.sums, self.samples, grad_norm.detach().to(torch.float64), skipped)

    def nonfinite(self) -> torch.Tensor:
        """1.0 when a metric (the loss among them) of this rank's step is not finite, else 0.0 (device)."""
        if self.sums is None:
            raise ValueError("train_step got no micro-batch with samples")
        return (~torch.isfinite(self.sums).all()).to(torch.float32)


class Engine:
    kind = "base"
    timed = False  # train_step marks a StepClock's compute and collectives (the slow-rank naming)

    def __init__(self, module: DistillModule, device: torch.device, precision: str, grad_clip: float) -> None:
        self.module = module
        self.device = device
        self.precision = precision
        self.grad_clip = grad_clip

    @property
    def student(self) -> nn.Module:
        return self.module.student

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.student.named_parameters())

    def train_step(self, microbatches: Iterable[Microbatch], lr: float,
                   clock: StepClock | None = None) -> StepMetrics:
        """One optimizer step; `clock`: marked where the engine is `timed`, ignored otherwise."""
        raise NotImplementedError

    def compiled_outcomes(self) -> list[str]:
        """How this process runs each input shape's student so far: "loaded", "saved", "compiled aside",
        "torch.compile", or eager ("eager, compiling aside"; "eager" after a SIGTERM ended that compile)
        (precompile.py); empty where the student is not precompiled."""
        forward = getattr(self, "forward", None)
        return sorted(forward.outcomes.values()) if isinstance(forward, PrecompiledForward) else []

    def evaluate(self, frames: torch.Tensor, teacher_latents: torch.Tensor | None) -> dict[str, float]:
        raise NotImplementedError

    def full_state(self) -> dict[str, Any]:
        raise NotImplementedError

    @torch.no_grad()
    def reconstruct(self, frames: torch.Tensor) -> torch.Tensor:
        """The student's reconstruction of `frames` (N×T×3×H×W, uint8 or in [0, 1]), in [0, 1]. Every rank
        calls it together: under ZeRO-3 the forward gathers each layer's weights from all ranks."""
        self.module.eval()
        x = to_unit(frames)
        if self.module.compute_dtype is not None:
            x = x.to(self.module.compute_dtype)
        with _autocast(self.device, self.precision):
            return self.student.decode_video(self.student.encode_video(x)).float()

    def load_full_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class FlatAllReduceEngine(Engine):
    """Replicated weights, AdamW, and ONE all-reduce of a flat gradient buffer per optimizer step.

    Plain data parallelism, but not torch's DistributedDataParallel: DDP overlaps communication with
    backward, but it rebuilds its gradient buckets after the first iteration, so the first step after a
    resume reduces in another order than the uninterrupted run and the weights differ in the last bits.
    Here every parameter's gradient is a fixed window of one buffer (made with `set_`, same layout on every
    start), so a resumed run is bit-identical. For an 11 M-parameter model the un-overlapped all-reduce
    (45 MB) costs little: 63.5 clips/s on one H200, 62.7 per GPU on four (docs/benchmarks.md). Configs name
    it `allreduce` (`ddp`, its old name, too).
    """

    kind = "allreduce"
    timed = True  # its one collective is the gradient all-reduce, between the compute and the optimizer

    def __init__(self, module: DistillModule, device: torch.device, precision: str, grad_clip: float,
                 lr: float, betas: tuple[float, float], weight_decay: float, compile: bool,
                 compile_mode: str = "default") -> None:
        super().__init__(module, device, precision, grad_clip)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        params = [p for p in module.parameters() if p.requires_grad]
        # One element more than the gradients: each rank's non-finite-loss flag, summed by the same
        # all-reduce, so every rank skips a bad step together without a collective of its own.
        self.flat_grad = torch.zeros(sum(p.numel() for p in params) + 1, device=device, dtype=torch.float32)
        storage, offset = self.flat_grad.untyped_storage(), 0
        # Each .grad a window of the buffer with its parameter's strides (channels_last too), sharing its
        # memory without being an autograd view of it: torch.compile fakes every parameter's .grad, and
        # rebuilding 128 views of one base took 6-7 s of each start, warm cache or not
        # (bench/compile_start.py).
        for p in params:
            p.grad = self.flat_grad.new_empty(0).set_(storage, offset, p.shape, p.stride())
            offset += p.numel()
        if self.world > 1:
            with torch.no_grad():
                for p in module.parameters():  # start from rank 0's weights, whatever each rank built
                    dist.broadcast(p.data, src=0)
        # dynamic=False: the last micro-batch of a rank may be smaller; it gets its own specialized graph
        # (at most two or three shapes) instead of a slower dynamic-shape one.
        self.forward = torch.compile(module, mode=compile_mode, dynamic=False) if compile else module
        if compile and FAST_PATHS["precompile"]:  # later starts load it instead of tracing (precompile.py)
            self.forward = PrecompiledForward(module, compile_mode, precompiled_folder(), self.forward)
        self.cuda_graphs = compile and compile_mode == "reduce-overhead"
        # Fused on GPUs: its `found_inf` skips a step's update (and step count) on the device, without
        # the host waiting for the GPU to learn whether the step was finite. The CPU's fused kernel
        # rounds differently (measured: 5-8x larger drift between world sizes after 5 steps than the
        # foreach AdamW), and on a CPU reading the flag costs nothing, so there the host skips.
        self.fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                                           fused=self.fused)

    def train_step(self, microbatches: Iterable[Microbatch], lr: float,
                   clock: StepClock | None = None) -> StepMetrics:
        self.module.train()
        if clock is not None:
            clock.compute_begins()
        self.flat_grad.zero_()  # keeps the windows (never set_to_none)
        sums = _MetricSums()
        for frames, latents, weight in microbatches:
            if self.cuda_graphs:  # each micro-step is a new replay of the graphs
                torch.compiler.cudagraph_mark_step_begin()
            with _autocast(self.device, self.precision):
                loss, metrics = self.forward(frames, latents)
            sums.add(metrics, frames.shape[0], weight)  # copied out before anything replays the graphs again
            (loss * weight).backward()
        self.flat_grad[-1] = sums.nonfinite()
        if self.world > 1:
            # Σ over ranks of Σ weight·∇loss = the mean over the effective batch
            with clock.collective() if clock is not None else contextlib.nullcontext():
                dist.all_reduce(self.flat_grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        skipped = (self.flat_grad[-1] > 0) | ~torch.isfinite(grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.fused:
            self.optimizer.found_inf = skipped.to(torch.float32)  # fused AdamW applies nothing where it is 1
            self.optimizer.step()
        elif not skipped:
            self.optimizer.step()
        if clock is not None:
            clock.stop()
        return sums.result(grad_norm, skipped)

    @torch.no_grad()
    def evaluate(self, frames: torch.Tensor, teacher_latents: torch.Tensor | None) -> dict[str, float]:
        self.module.eval()
        with _autocast(self.device, self.precision):
            _, m = self.module(frames, teacher_latents)
        return summarize([m])

    def full_state(self) -> dict[str, Any]:
        params, exp_avg, exp_avg_sq, step = {}, {}, {}, 0
        for name, p in self.named_parameters():
            params[name] = p.detach().float().cpu().clone()
            st = self.optimizer.state.get(p)
            if st:
                exp_avg[name] = st["exp_avg"].detach().float().cpu().clone()
                exp_avg_sq[name] = st["exp_avg_sq"].detach().float().cpu().clone()
                step = int(st["step"])
        return {"params": params, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "optimizer_step": step}

    def load_full_state(self, state: dict[str, Any]) -> None:
        _check_names(self.named_parameters(), state["params"])
        for name, p in self.named_parameters():
            with torch.no_grad():
                p.copy_(state["params"][name].to(p.dtype))
            if name in state["exp_avg"]:
                # The layout torch's AdamW creates itself (fused keeps `step` on the device).
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(state["optimizer_step"]), dtype=torch.float32,
                                         device=p.device if self.fused else "cpu"),
                    "exp_avg": state["exp_avg"][name].to(p.device, p.dtype).clone(),
                    "exp_avg_sq": state["exp_avg_sq"][name].to(p.device, p.dtype).clone(),
                }


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO stage 1/2/3 with torch's AdamW (works on CPU with gloo and on GPU with NCCL).

    Only DeepSpeed's public API: `deepspeed.initialize` and the engine's forward/backward/step,
    `deepspeed.utils.safe_{get,set}_{full,local}_*` for the fp32 weights and AdamW moments, and
    `deepspeed.zero.GatheredParameters` (tested with the DeepSpeed range setup.cfg names).
    """

    def __init__(self, module: DistillModule, device: torch.device, precision: str, grad_clip: float,
                 lr: float, betas: tuple[float, float], weight_decay: float, compile: bool,
                 stage: int, per_gpu_batch: int, grad_accum: int) -> None:
        super().__init__(module, device, precision, grad_clip)
        deepspeed = _import_deepspeed()

        self.kind = f"zero{stage}"
        self.stage = stage
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.grad_accum = grad_accum
        bf16 = device.type == "cuda" and precision == "bf16"
        config = {
            "train_micro_batch_size_per_gpu": per_gpu_batch,
            "gradient_accumulation_steps": grad_accum,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        # DeepSpeed views each parameter as bytes to broadcast it, which channels_last weights refuse.
        module.to(memory_format=torch.contiguous_format)
        # Our own AdamW object: DeepSpeed wraps it and keeps stepping it, so its state (the step count)
        # is readable here without reaching into DeepSpeed's optimizer.
        self.adamw = torch.optim.AdamW(module.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=self.adamw,
                                                             config=config, dist_init_required=False)
        module.compute_dtype = torch.bfloat16 if bf16 else None
        compiled = compile and self.kind in COMPILED_ENGINES and device.type == "cuda"  # plan.py: not zero3
        if compiled and hasattr(self.ds, "compile"):
            self.ds.compile()  # default mode: ZeRO's hooks run collectives that CUDA graphs cannot capture

    def train_step(self, microbatches: Iterable[Microbatch], lr: float,
                   clock: StepClock | None = None) -> StepMetrics:
        self.ds.train()  # not timed: ZeRO's collectives run inside its backward and step
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums = _MetricSums()
        count = 0
        for frames, latents, weight in microbatches:
            loss, metrics = self.ds(frames, latents)
            sums.add(metrics, frames.shape[0], weight)
            # DeepSpeed divides each micro-step's loss by the accumulation steps and averages the ranks'
            # gradients; undo both so the step's gradient is Σ weight·∇loss over every rank.
            self.ds.backward(loss * (weight * self.world * self.grad_accum))
            self.ds.step()  # updates only at the accumulation boundary
            count += 1
        if count != self.grad_accum:  # ZeRO-2/3 run collectives in every micro-step: all ranks must agree
            raise ValueError(f"DeepSpeed engine configured for {self.grad_accum} micro-batches per step, "
                             f"got {count}")
        # DeepSpeed's ZeRO optimizers find a non-finite gradient themselves (all ranks together) and skip
        # the update; its global norm then reads inf (tests/test_engine.py checks the skip for 1, 2, 3).
        norm = self.ds.get_global_grad_norm()
        norm = torch.as_tensor(float("nan") if norm is None else float(norm), device=self.device)
        return sums.result(norm, ~torch.isfinite(norm))

    @torch.no_grad()
    def evaluate(self, frames: torch.Tensor, teacher_latents: torch.Tensor | None) -> dict[str, float]:
        self.ds.eval()
        _, m = self.ds(frames, teacher_latents)
        return summarize([m])

    def reconstruct(self, frames: torch.Tensor) -> torch.Tensor:
        if self.stage < 3:
            return super().reconstruct(frames)
        import deepspeed

        # ZeRO-3 keeps a shard of each weight per rank; the model's fast paths read whole weights.
        with deepspeed.zero.GatheredParameters(list(self.student.parameters())):
            return super().reconstruct(frames)

    def full_state(self) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params, exp_avg, exp_avg_sq = {}, {}, {}
        for name, p in self.named_parameters():  # same order on every rank: ZeRO-3 gathers collectively
            params[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
            for key, out in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                value = safe_get_full_optimizer_state(p, key)
                if value is not None:
                    out[name] = value.detach().float().cpu().clone()
        return {"params": params, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                "optimizer_step": self._adamw_step()}

    def load_full_state(self, state: dict[str, Any]) -> None:
        import deepspeed
        from deepspeed.utils import (
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        _check_names(self.named_parameters(), state["params"])
        have_moments = bool(state["exp_avg"])
        if have_moments and not any(self.adamw.state.values()):
            self._create_optimizer_state()
        for name, p in self.named_parameters():
            value = state["params"][name].to(self.device)
            if self.stage == 3:  # this rank's slice (DeepSpeed's full setter cannot pad a small tensor's
                # partition)
                safe_set_local_fp32_param(p, self._local_slice(value, p))
            else:
                safe_set_full_fp32_param(p, value)
            if have_moments and name in state["exp_avg"]:
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = state[key][name].to(self.device)
                    if self.stage == 3:
                        safe_set_local_optimizer_state(p, self._local_slice(moment, p), key)
                    else:
                        safe_set_full_optimizer_state(p, moment, key)
        for s in self.adamw.state.values():
            if "step" in s:
                s["step"] = (torch.full_like(s["step"], float(state["optimizer_step"]))
                             if torch.is_tensor(s["step"]) else state["optimizer_step"])
        # The setters above write the fp32 master copy; the model's own weights follow it only at the
        # next optimizer step, so copy them now or the first forward after a resume uses stale ones.
        params = dict(self.named_parameters())
        gathered = deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0) \
            if self.stage == 3 else contextlib.nullcontext()
        with gathered, torch.no_grad():
            for name, p in params.items():
                p.data.copy_(state["params"][name].to(p.device, p.dtype))

    def _adamw_step(self) -> int:
        return max((int(s["step"]) for s in self.adamw.state.values() if "step" in s), default=0)

    def _local_slice(self, value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        """This rank's part of a full tensor as ZeRO-3 partitions it: equal slices of the flat tensor,
        the last ones zero-padded (a bias of 3 over 4 ranks)."""
        from deepspeed.utils import safe_get_local_fp32_param

        size = safe_get_local_fp32_param(param).numel()
        flat = value.flatten()
        start = size * (dist.get_rank() if dist.is_initialized() else 0)
        part = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        count = max(0, min(size, flat.numel() - start))
        part[:count] = flat[start:start + count]
        return part

    def _create_optimizer_state(self) -> None:
        """AdamW creates its moments at its first step, and DeepSpeed maps each parameter to its slice of
        them only then: one optimizer step through the engine with lr 0 and a zero loss creates both
        without changing a weight (weight decay is scaled by lr too)."""
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        # the smallest clip TAEHV takes
        frames = torch.zeros(1, 4, 3, 8, 8, dtype=torch.uint8, device=self.device)
        for _ in range(self.grad_accum):  # one whole accumulation cycle: the next real step starts a new one
            loss, _ = self.ds(frames, None)
            self.ds.backward(loss * 0.0)
            self.ds.step()
        for g, lr in zip(self.optimizer.param_groups, saved):
            g["lr"] = lr


def _check_names(named: list[tuple[str, nn.Parameter]], stored: dict[str, torch.Tensor]) -> None:
    mine = {n: tuple(p.shape) if p.numel() else None for n, p in named}
    missing = sorted(set(mine) - set(stored))
    extra = sorted(set(stored) - set(mine))
    if missing or extra:
        raise ValueError(f"checkpoint parameters do not match the model: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")


# What DeepSpeed (0.19, setup.cfg's range) itself calls in torch 2.13 that torch deprecates: its collectives
# and its Muon optimizer's `torch.jit.script_method`. Nothing a user can change, once per call site in every
# rank's log; silenced by their exact text, so any other warning still shows (the suite fails on those:
# setup.cfg's filterwarnings).
DEEPSPEED_DEPRECATIONS = (
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated"),
)


def _import_deepspeed() -> Any:
    """`import deepspeed` without the `import mlflow` of its autotuner (which this project never runs):
    where mlflow is installed that import costs every ZeRO rank about 2 CPU-seconds at its start. A
    tracker that logs to MLflow imports it as usual afterwards. DeepSpeed's own uses of deprecated torch
    calls stay quiet (DEEPSPEED_DEPRECATIONS)."""
    for category, message in DEEPSPEED_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category)
    hide = "mlflow" not in sys.modules and "deepspeed" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` now raises ImportError
    try:
        import deepspeed
    finally:
        if hide:
            del sys.modules["mlflow"]
    return deepspeed


def make_engine(kind: str, module: DistillModule, device: torch.device, *, precision: str, grad_clip: float,
                lr: float, betas: tuple[float, float], weight_decay: float, compile: bool,
                per_gpu_batch: int, grad_accum: int, compile_mode: str = "default") -> Engine:
    """The engine `kind` (allreduce, zero1, zero2, zero3) around `module`.

    per_gpu_batch / grad_accum: the largest micro-batch and the micro-batches per step (every rank runs
    that many; DeepSpeed needs both)."""
    common = dict(lr=lr, betas=betas, weight_decay=weight_decay, compile=compile)
    if kind == "allreduce":
        return FlatAllReduceEngine(module, device, precision, grad_clip, compile_mode=compile_mode, **common)
    if kind in ("zero1", "zero2", "zero3"):
        if missing := missing_engine_package(kind):
            raise ConfigError(missing)
        return DeepSpeedEngine(module, device, precision, grad_clip, stage=int(kind[-1]),
                               per_gpu_batch=per_gpu_batch, grad_accum=grad_accum, **common)
    raise ValueError(f"unknown engine {kind!r}: use allreduce, zero1, zero2 or zero3")
