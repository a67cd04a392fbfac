"""The scale plan: one training config → the settings for ANY number of nodes and GPUs.

Pure functions, no I/O. The effective batch (per-GPU batch × world size × gradient accumulation) is
held constant, so the optimisation is the same on 1 GPU or 1000 and a run can resume at another
world size. What changes with the GPU count is only how the batch is split, the engine that fits,
and the NCCL settings for the node count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError, TrainConfig, load_train

# Throughput of each engine relative to DDP, measured on H200s (docs/benchmarks.md): 2 GPUs, a
# TAEHV-shaped model (ZeRO-2 −7 %, ZeRO-3 −18 %), and 1 GPU with our model (ZeRO-2 −30 %). ZeRO buys
# no memory worth its cost for an 11 M-parameter model, so the plan prefers DDP and moves to ZeRO only
# when parameters + optimizer states do not fit.
ENGINE_RELATIVE_SPEED = {"ddp": 1.0, "zero1": 0.95, "zero2": 0.93, "zero3": 0.82}
# Activation memory of one 12×480×720 clip in a bf16 training step (encoder + decoder, forward +
# backward, torch.compile), measured on H200: peak 35.1 GiB at batch 8 → 4.4 GiB per clip (17.5 GiB
# at batch 4). Scales with frames × pixels.
ACTIVATION_GB_PER_REFERENCE_CLIP = 4.4
REFERENCE_CLIP_ELEMENTS = 12 * 480 * 720
# Activation checkpointing keeps about a third of the activations (the block inputs), measured shape.
CHECKPOINTED_ACTIVATION_FRACTION = 0.35
GPU_MEMORY_HEADROOM = 0.9  # leave 10 % for the allocator, NCCL buffers and compile workspaces
# Raw-video loading, measured on a 16-core H200 host (bench/loader_throughput.py, prepare_throughput.py):
# one CPU core decodes 6.4 clips/s of 12×480×720 H.264; one loader worker (with its decode threads)
# delivers ~17 clips/s when 8 run at once. The trainer needs ~55 clips/s per H200 (docs/benchmarks.md).
DECODE_CLIPS_PER_CORE = 6.4
DECODE_CLIPS_PER_WORKER = 17.0
TRAIN_CLIPS_PER_GPU = 55.0

NCCL_TIMEOUT_BY_NODES = ((1, 3600), (2, 7200), (8, 14400))  # (from this many nodes, seconds)


@dataclass(frozen=True)
class ScalePlan:
    num_nodes: int
    gpus_per_node: int
    world_size: int
    per_gpu_batch: int
    grad_accum: int
    effective_batch: int
    lr: float
    warmup_steps: int
    total_steps: int
    engine: str
    engine_reason: str
    precision: str
    memory_per_gpu_gb: float
    nccl_timeout_s: int
    nccl_env: dict[str, str] = field(default_factory=dict)
    num_workers: int = 0
    prefetch_factor: int = 2
    log_every: int = 25
    val_every: int = 1000
    ckpt_every: int = 2000
    samples_per_rank_per_step: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """A two-column table for `jobs.submit --dry-run` and notebooks."""
        rows = [
            ("GPUs", f"{self.world_size} = {self.num_nodes} node(s) × {self.gpus_per_node}"),
            ("effective batch", f"{self.effective_batch} = {self.per_gpu_batch} per GPU × {self.world_size} GPUs × {self.grad_accum} accumulation"),
            ("lr / warmup", f"{self.lr:.3g} / {self.warmup_steps} steps (of {self.total_steps})"),
            ("engine", f"{self.engine} ({self.engine_reason})"),
            ("precision", self.precision),
            ("memory per GPU", f"≈{self.memory_per_gpu_gb:.1f} GB (estimate)"),
            ("collective timeout", f"{self.nccl_timeout_s} s"),
            ("NCCL env", " ".join(f"{k}={v}" for k, v in self.nccl_env.items()) or "-"),
            ("loader", f"{self.num_workers} workers/GPU, prefetch {self.prefetch_factor}"),
            ("log / val / ckpt", f"every {self.log_every} / {self.val_every} / {self.ckpt_every} steps"),
        ] + [("note", note) for note in self.notes]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def plan_for(num_nodes: int, gpus_per_node: int, train: TrainConfig | Mapping[str, Any] | None = None, *,
             gpu_memory_gb: float = 80.0, cpus_per_task: int | None = None, device: str = "cuda") -> ScalePlan:
    """The plan for `num_nodes` × `gpus_per_node` ranks.

    gpus_per_node is the number of ranks per node (one per GPU); 0 means one rank per node. With
    device="cpu" (tests, CPU-only nodes) there is no GPU memory limit, fp32 and no NCCL settings.
    """
    cfg = train if isinstance(train, TrainConfig) else load_train(train or {})
    if num_nodes < 1:
        raise ConfigError(f"nodes must be ≥ 1, got {num_nodes}")
    if gpus_per_node < 0:
        raise ConfigError(f"gpus_per_node must be ≥ 0, got {gpus_per_node}")
    ranks_per_node = max(1, gpus_per_node)
    world = num_nodes * ranks_per_node
    per_gpu, accum = _split_batch(cfg, world, ranks_per_node)

    states_gb = {name: _state_bytes(name, cfg, world) / 1e9 for name in ENGINE_RELATIVE_SPEED}
    act_gb = _activation_gb(cfg, per_gpu)
    budget = gpu_memory_gb * GPU_MEMORY_HEADROOM
    on_gpu = gpus_per_node > 0 and device != "cpu"
    if cfg.engine.kind != "auto":
        engine = cfg.engine.kind
        reason = "set in the config"
        if on_gpu and states_gb[engine] + act_gb > budget:
            raise ConfigError(
                f"engine {engine} needs ≈{states_gb[engine] + act_gb:.0f} GB per GPU with per-GPU batch "
                f"{per_gpu} but {gpu_memory_gb:.0f} GB are available: lower batch.per_gpu or set engine.kind: auto"
            )
    else:
        fitting = [e for e in ENGINE_RELATIVE_SPEED if not on_gpu or states_gb[e] + act_gb <= budget]
        if not fitting:
            raise ConfigError(
                f"no engine fits {gpu_memory_gb:.0f} GB per GPU at per-GPU batch {per_gpu} "
                f"(activations ≈{act_gb:.0f} GB): lower batch.per_gpu or enable engine.activation_checkpointing"
            )
        engine = max(fitting, key=lambda e: ENGINE_RELATIVE_SPEED[e])
        slower = ", ".join(f"{e} {100 * (ENGINE_RELATIVE_SPEED[e] - 1):+.0f} %" for e in ENGINE_RELATIVE_SPEED if e != engine)
        reason = f"fastest that fits; measured vs ddp: {slower}" if engine == "ddp" else f"ddp does not fit; {engine} does"

    timeout = max(t for n, t in NCCL_TIMEOUT_BY_NODES if num_nodes >= n)
    nccl_env: dict[str, str] = {}
    if on_gpu:
        nccl_env = {
            "NCCL_BUFFSIZE": str((32 if num_nodes >= 8 else 16) * 1024 * 1024),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a timed-out collective raises instead of hanging
        }
        if num_nodes > 1:
            nccl_env["NCCL_IB_TIMEOUT"] = "22"  # longer IB retry window on large fabrics

    workers, prefetch = _loader_settings(cfg, cpus_per_task)
    notes = []
    if cfg.data.source == "video" and on_gpu:
        pixels = cfg.data.frames * cfg.data.height * cfg.data.width / REFERENCE_CLIP_ELEMENTS
        cores = TRAIN_CLIPS_PER_GPU * pixels / DECODE_CLIPS_PER_CORE
        if cores > (cpus_per_task or 8):
            notes.append(f"decoding raw video needs ≈{cores:.0f} CPU cores per GPU to keep up "
                         f"(cpus_per_task={cpus_per_task or 8}): prepare the data once with `python -m jobs.prepare`")
    scale = _lr_scale(cfg)
    return ScalePlan(
        num_nodes=num_nodes,
        gpus_per_node=gpus_per_node,
        world_size=world,
        per_gpu_batch=per_gpu,
        grad_accum=accum,
        effective_batch=cfg.batch.effective,
        lr=cfg.optim.lr * scale,
        warmup_steps=cfg.optim.warmup_steps,
        total_steps=cfg.steps,
        engine=engine,
        engine_reason=reason,
        precision=cfg.engine.precision if on_gpu else "fp32",
        memory_per_gpu_gb=round(states_gb[engine] + act_gb, 2),
        nccl_timeout_s=timeout,
        nccl_env=nccl_env,
        num_workers=workers,
        prefetch_factor=prefetch,
        log_every=cfg.intervals.log_every,
        val_every=cfg.intervals.val_every,
        ckpt_every=cfg.intervals.ckpt_every,
        samples_per_rank_per_step=per_gpu * accum,
        notes=notes,
    )


def valid_gpu_counts(effective_batch: int, near: int, multiple_of: int = 1, count: int = 2) -> list[int]:
    """GPU counts that split `effective_batch` evenly, nearest to `near` (multiples of `multiple_of`)."""
    candidates = [w for w in range(multiple_of, effective_batch + 1, multiple_of) if effective_batch % w == 0]
    return sorted(sorted(candidates, key=lambda w: (abs(w - near), w))[:count])


def _split_batch(cfg: TrainConfig, world: int, ranks_per_node: int) -> tuple[int, int]:
    effective, cap, accum = cfg.batch.effective, cfg.batch.per_gpu, cfg.batch.grad_accum
    if effective % world:
        nearest = valid_gpu_counts(effective, world, ranks_per_node) or valid_gpu_counts(effective, world)
        alternatives = sorted({world * k for k in (max(1, effective // world), -(-effective // world))})
        raise ConfigError(
            f"effective batch {effective} cannot be split evenly over {world} GPUs: use "
            f"{' or '.join(map(str, nearest))} GPUs, or set batch.effective to "
            f"{' or '.join(map(str, alternatives))} (a multiple of {world})"
        )
    per_rank = effective // world  # samples each rank contributes to one optimizer step
    if accum is not None:
        if per_rank % accum:
            raise ConfigError(
                f"batch.grad_accum={accum} does not divide the {per_rank} samples per GPU per step "
                f"({effective} over {world} GPUs): remove batch.grad_accum or use a divisor of {per_rank}"
            )
        return per_rank // accum, accum
    per_gpu = max(d for d in range(1, min(cap, per_rank) + 1) if per_rank % d == 0)
    return per_gpu, per_rank // per_gpu


def taehv_param_count(cfg: TrainConfig) -> int:
    """Parameters of the TAEHV student for this config, counted from its layer shapes."""
    m = cfg.model
    conv3 = lambda cin, cout, bias=True: cin * cout * 9 + (cout if bias else 0)  # noqa: E731
    def memblock(c: int) -> int:
        return conv3(2 * c, c) + 2 * conv3(c, c)
    e, pix = m.encoder_width, 3 * m.patch_size**2
    tpool = [2, 2, 1]
    enc = conv3(pix, e) + sum(e * s * e + conv3(e, e, False) + 3 * memblock(e) for s in tpool) + conv3(e, m.latent_channels)
    w = m.decoder_widths
    tgrow = [1, 2, 2]
    dec = conv3(m.latent_channels, w[0])
    for i in range(3):
        dec += 3 * memblock(w[i]) + w[i] * w[i] * tgrow[i] + conv3(w[i], w[i + 1], False)
    dec += conv3(w[3], pix)
    return enc + dec


def _state_bytes(engine: str, cfg: TrainConfig, world: int) -> float:
    p = taehv_param_count(cfg)
    weights, grads, adam = 4.0 * p, 4.0 * p, 8.0 * p  # fp32 master weights, grads, two Adam moments
    if engine == "zero1":
        return weights + grads + adam / world
    if engine == "zero2":
        return weights + (grads + adam) / world
    if engine == "zero3":
        return (weights + grads + adam) / world
    return weights + grads + adam


def _activation_gb(cfg: TrainConfig, per_gpu: int) -> float:
    d = cfg.data
    elements = d.frames * d.height * d.width
    gb = ACTIVATION_GB_PER_REFERENCE_CLIP * elements / REFERENCE_CLIP_ELEMENTS * per_gpu
    if cfg.engine.precision == "fp32":
        gb *= 2
    if cfg.engine.activation_checkpointing:
        gb *= CHECKPOINTED_ACTIVATION_FRACTION
    return gb


def _loader_settings(cfg: TrainConfig, cpus_per_task: int | None) -> tuple[int, int]:
    d = cfg.data
    spare = max(0, (cpus_per_task or 8) - 1)  # one core drives the GPU
    if d.source == "video":
        pixels = d.frames * d.height * d.width / REFERENCE_CLIP_ELEMENTS
        wanted = math.ceil(TRAIN_CLIPS_PER_GPU * pixels / DECODE_CLIPS_PER_WORKER)
        auto_workers, auto_prefetch = min(spare, max(1, wanted)), 4
    elif d.source == "prepared":
        auto_workers, auto_prefetch = min(spare, 2), 4
    else:
        auto_workers, auto_prefetch = (min(spare, 2) if d.height * d.width >= 256 * 256 else 0), 2
    workers = d.num_workers if d.num_workers is not None else auto_workers
    prefetch = d.prefetch_factor if d.prefetch_factor is not None else auto_prefetch
    return workers, prefetch


def _lr_scale(cfg: TrainConfig) -> float:
    ratio = cfg.batch.effective / cfg.optim.reference_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.optim.lr_scaling]
