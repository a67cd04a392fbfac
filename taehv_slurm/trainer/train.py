"""The training loop every rank runs (`TrainTask` calls `run_training`). One readable loop, top to bottom:

    env → process group → plan for the real world size → data, teacher, student, engine
    → resume from `latest` (any world size, any engine) → loop:
         agree on signals → this rank's micro-batches (streamed from the loader) → step
         → log / validate / checkpoint
    → final checkpoint

Only rank 0 writes metrics (JSON lines + TensorBoard) and shows progress; every rank takes part in
saves (ZeRO-3 gathers) and in the signal agreement. Each log line says which fraction of the window
the ranks spent waiting for data (the slowest rank's); above DATA_WAIT_WARN rank 0 warns once.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from taehv_slurm.config import RuntimeSettings, TrainConfig, load_train
from taehv_slurm.messages import command, rank_logger
from taehv_slurm.plan import ScalePlan, plan_for
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.context import RunContext
from taehv_slurm.runtime.distenv import DistEnv, destroy_distributed, init_distributed
from taehv_slurm.trainer.data import ClipSpec, GlobalOrder, SyntheticClips, VideoFolderClips, microbatches
from taehv_slurm.trainer.engine import Engine, Microbatch, make_engine
from taehv_slurm.trainer.losses import DistillModule
from taehv_slurm.trainer.metrics import LogWindow, MetricsWriter
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, init_for_training, load_published_weights
from taehv_slurm.trainer.rng import get_rng_state, seed_all, set_rng_state
from taehv_slurm.trainer.schedule import lr_at
from taehv_slurm.trainer.teacher import load_teacher

log = logging.getLogger("taehv")
DATA_WAIT_WARN = 0.10  # warn once when the ranks wait for data longer than this fraction of a log window


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was trained with another model shape; the message names the fields."""


def run_training(train: Mapping[str, Any], rt: RuntimeSettings, ctx: RunContext | None) -> dict[str, Any]:
    """What `TrainTask` runs on every rank: settings → process group → `Trainer.run` → teardown."""
    cfg = load_train(train)
    ctx = ctx or RunContext.standalone(rt.run_dir or Path("runs") / cfg.name)
    env = ctx.env
    rank_logger(log.name, env.rank)  # our logger only: submitit logs through its own handler
    device = _device(rt.device, env)
    configure_backends(device)
    torch.set_num_threads(rt.torch_threads)
    plan = plan_for(env.num_nodes, env.local_world_size, cfg, gpu_memory_gb=rt.gpu_memory_gb,
                    cpus_per_task=rt.cpus_per_task, device=device.type)
    for key, value in plan.nccl_env.items():
        os.environ.setdefault(key, value)
    init_distributed(env, rt.dist_backend, timeout_s=rt.collective_timeout_s or plan.nccl_timeout_s,
                     rendezvous_timeout_s=rt.rendezvous_timeout_s,
                     use_cuda=device.type == "cuda")
    try:
        return Trainer(cfg, plan, env, device, ctx).run()
    finally:
        destroy_distributed()


class Trainer:
    def __init__(self, cfg: TrainConfig, plan: ScalePlan, env: DistEnv, device: torch.device,
                 ctx: RunContext) -> None:
        self.cfg, self.plan, self.env, self.device, self.ctx = cfg, plan, env, device, ctx
        self.run_dir = ctx.run_dir
        self.main = env.rank == 0
        self.step_samples: list[int] = []  # this rank's clip indices of the current step (record_samples)
        self.checkpoints = Checkpointer(self.run_dir / "checkpoints", keep=cfg.intervals.keep_checkpoints,
                                        group=os.environ.get("TAEHV_SHARED_GROUP") or None,
                                        trust_root=self.run_dir)

    # ---------------------------------------------------------------------------------- setup
    def build(self) -> None:
        cfg, plan = self.cfg, self.plan
        self.train_source, self.val_source = build_sources(cfg)
        self.teacher = None
        if cfg.teacher.kind != "none":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            self.teacher = load_teacher(cfg.teacher.kind, cfg.teacher.path or "", cfg.teacher.scaling_factor,
                                        cfg.seed).to(self.device, dtype)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        student = TAEHV(TAEHVConfig.from_dict(_model_fields(cfg)))
        if cfg.model.init_from:
            load_published_weights(student, cfg.model.init_from)
        else:
            init_for_training(student)
        student.to(self.device)
        if cfg.engine.channels_last and self.device.type == "cuda":
            student.to(memory_format=torch.channels_last)
        module = DistillModule(student, cfg.loss.latent_weight, cfg.loss.reconstruction_weight,
                               cfg.loss.decoder_weight)
        self.engine: Engine = make_engine(
            plan.engine, module, self.device, precision=plan.precision, grad_clip=cfg.optim.grad_clip,
            lr=plan.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
            compile=cfg.engine.compile and self.device.type == "cuda", compile_mode=cfg.engine.compile_mode,
            per_gpu_batch=plan.per_gpu_batch, grad_accum=plan.grad_accum,
        )

    def resume(self) -> int:
        loaded = self.checkpoints.load_latest()
        if self.main:
            for line in self.checkpoints.moved_aside:
                log.warning(line)
        if loaded is None:
            return 0
        step, state, meta = loaded
        check_compatible(meta, self.cfg, self.checkpoints.directory / f"step_{step:08d}")
        self.engine.load_full_state(state)
        rng = state.get("rng") or []
        if len(rng) == self.env.world_size:  # same layout: each rank continues its own streams
            set_rng_state(rng[self.env.rank])
        else:  # another world size: fresh, deterministic per-rank streams (data order does not use them)
            seed_all(self.cfg.seed * 1_000_003 + step * 1009 + self.env.rank)
        if self.main:
            log.info("resumed from step %d (saved by %d ranks, engine %s; now %d ranks, engine %s)",
                     step, meta.get("world_size", 0), meta.get("engine"), self.env.world_size,
                     self.plan.engine)
        return step

    # ------------------------------------------------------------------------------------ loop
    def run(self) -> dict[str, Any]:
        cfg, plan, env, ctx = self.cfg, self.plan, self.env, self.ctx
        self.build()
        step = self.resume()
        ctx.started(step, engine=plan.engine, effective_batch=plan.effective_batch,
                    grad_accum=plan.grad_accum)
        if self.main:
            log.info("plan for %d ranks:\n%s", env.world_size, plan.table())
        metrics = MetricsWriter(self.run_dir, step, enabled=self.main, total=cfg.steps)
        sizes = plan.microbatch_sizes(env.rank)
        stream = microbatches(self.train_source, GlobalOrder(len(self.train_source), cfg.seed), step,
                              plan.effective_batch, plan.first_sample(env.rank), sizes,
                              num_workers=plan.num_workers,
                              prefetch_factor=plan.prefetch_factor, pin_memory=self.device.type == "cuda")
        window = LogWindow(self.device)
        last: dict[str, float] = {}
        if step >= cfg.steps and self.main:
            log.warning("nothing to train: the checkpoint is at step %d and steps is %d; "
                        "submit with a higher --set steps=N to train on", step, cfg.steps)
        resumed_at = step
        while step < cfg.steps:
            ctx.step_boundary(step, functools.partial(self.save_at_signal, step, metrics), self.device)
            lr = lr_at(step, plan.lr, plan.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio)
            window.add(self.engine.train_step(self.step_microbatches(stream, sizes, window), lr))
            step += 1
            if cfg.intervals.record_samples:
                metrics.write_samples(step, self.gather_samples())
            if step % plan.log_every == 0 or step == cfg.steps or step == 1:
                last = {**window.close(plan.effective_batch), "lr": lr,
                        "gpu_memory_gb": _gpu_memory_gb(self.device)}
                metrics.write(step, last)
                if self.main and step > 1 and last["data_wait"] > DATA_WAIT_WARN and not window.warned:
                    log.warning(data_wait_advice(last["data_wait"], plan, cfg.data.source))
                    window.warned = True
            if step % plan.val_every == 0 or step == cfg.steps:
                metrics.write(step, self.validate(), prefix="val")
            if step % plan.ckpt_every == 0 and step < cfg.steps:
                self.save(step, blocking=not cfg.intervals.async_checkpoint)
        if step > resumed_at:  # a run resumed at its last step keeps its checkpoint as it is
            self.save(step, blocking=True)
        metrics.close()
        ctx.finished(step)
        return {"step": step, "rank": env.rank, "world_size": env.world_size, "engine": plan.engine,
                **{k: last.get(k) for k in ("loss", "psnr", "reconstruction_loss", "latent_loss")},
                "checkpoint": str(self.checkpoints.directory / f"step_{step:08d}")}

    def save_at_signal(self, step: int, metrics: MetricsWriter) -> None:
        self.save(step, blocking=True)
        metrics.close()

    def step_microbatches(self, stream: Iterator[dict[str, Any]], sizes: list[int],
                          window: LogWindow) -> Iterator[Microbatch]:
        """This rank's micro-batches of one step, pulled from the loader one at a time (the GPU works on
        one while the next is loaded), each weighted by its share of the effective batch."""
        self.step_samples.clear()
        for size in sizes:
            began = time.perf_counter()
            batch = next(stream)
            window.data_wait_s += time.perf_counter() - began
            if size:  # a padding micro-batch repeats a sample with weight 0: not part of the step
                self.step_samples += batch["index"].tolist()
            yield Microbatch(*self.to_device(batch), size / self.plan.effective_batch)

    def gather_samples(self) -> list[int]:
        """The clip indices of the step just trained, every rank's share in rank order (collective)."""
        if not (dist.is_initialized() and self.env.world_size > 1):
            return list(self.step_samples)
        shares: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(shares, self.step_samples)
        return [i for share in shares for i in share]

    def to_device(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        frames = batch["frames"].to(self.device, non_blocking=True)
        if "latents" in batch:
            latents = batch["latents"].to(self.device, non_blocking=True)
        elif self.teacher is not None:
            latents = self.teacher.latents(frames)
        else:
            latents = None
        return frames, latents

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean PSNR/losses on the held-out clips; rank r takes clips r, r + world, r + 2·world, …"""
        mine = list(range(self.env.rank, len(self.val_source), self.env.world_size))
        # A rank without clips (more ranks than clips) still evaluates clip 0 for the metric names
        # and weights it 0, so every rank reduces the same vector.
        weights = [1.0] * len(mine) if mine else [0.0]
        totals, keys = None, []
        for i, weight in zip(mine or [0], weights):
            batch = {k: (v.unsqueeze(0) if torch.is_tensor(v) else v) for k, v in self.val_source[i].items()}
            m = self.engine.evaluate(*self.to_device(batch))
            keys = list(m)
            vec = torch.tensor(list(m.values()), dtype=torch.float64) * weight
            totals = vec if totals is None else totals + vec
        packed = torch.cat([totals, torch.tensor([sum(weights)], dtype=torch.float64)]).to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        n = max(1.0, float(packed[-1]))
        return {k: float(v) / n for k, v in zip(keys, packed[:-1].tolist())}

    def save(self, step: int, blocking: bool) -> None:
        """Every rank takes part (ZeRO-3 gathers; RNG states are gathered); rank 0 writes."""
        start = time.perf_counter()
        state = self.engine.full_state()
        rngs: list[Any] = [None] * self.env.world_size
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_gather_object(rngs, get_rng_state())
        else:
            rngs = [get_rng_state()]
        if self.main:
            state = {**state, "rng": rngs, "step": step}
            meta = {"world_size": self.env.world_size, "engine": self.plan.engine,
                    "model": _model_fields(self.cfg),
                    "config": self.cfg.to_dict(), "plan": self.plan.to_dict(), "host": socket.gethostname(),
                    "data_position": step * self.plan.effective_batch}
            # full_state() already copied everything off the GPU, so the writer thread owns its tensors
            self.checkpoints.save(state, step, meta, blocking=blocking)
            if blocking:
                self.checkpoints.wait()
        if dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()
        if self.main:
            log.info("checkpoint step %d %s in %.2f s", step, "saved" if blocking else "handed to the writer",
                     time.perf_counter() - start)


# ------------------------------------------------------------------------------------ helpers


def build_sources(cfg: TrainConfig):
    """(train source, validation source) for the configured data."""
    d = cfg.data
    spec = ClipSpec(d.frames, d.height, d.width)
    if d.source == "synthetic":
        return (SyntheticClips(d.num_clips, spec, cfg.seed),
                SyntheticClips(max(1, d.val_clips), spec, cfg.seed + 7919))
    if d.source == "video":
        clips = VideoFolderClips(d.path or "", spec, seed=cfg.seed)
    else:
        from taehv_slurm.trainer.prepared import PreparedClips

        clips = PreparedClips(d.path or "", spec)
    n_val = min(d.val_clips, max(0, len(clips) - 1))
    train_idx = list(range(len(clips) - n_val))
    val_idx = list(range(len(clips) - n_val, len(clips)))
    return torch.utils.data.Subset(clips, train_idx), torch.utils.data.Subset(clips, val_idx)


def check_compatible(meta: Mapping[str, Any], cfg: TrainConfig, where: Path) -> None:
    saved, now = meta.get("model", {}), _model_fields(cfg)
    differ = [f"{k}: checkpoint {saved.get(k)!r} vs config {now[k]!r}" for k in now
              if k in saved and saved[k] != now[k]]
    if differ:
        raise IncompatibleCheckpointError(
            f"checkpoint {where} was trained with another model ({'; '.join(differ)}); "
            "set those model.* values back, or start a new run (--name) for the new model"
        )


def _model_fields(cfg: TrainConfig) -> dict[str, Any]:
    m = cfg.model
    return {"latent_channels": m.latent_channels, "patch_size": m.patch_size,
            "encoder_width": m.encoder_width, "decoder_widths": list(m.decoder_widths)}


def configure_backends(device: torch.device) -> None:
    """Kernel choices for training on `device`: cuDNN tries its algorithms once per input shape and keeps
    the fastest (a rank sees at most three shapes: the micro-batch, a smaller last one, validation)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def _device(choice: str, env: DistEnv) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank)


def data_wait_advice(fraction: float, plan: ScalePlan, source: str) -> str:
    """One line for a trainer that waits for its data: how much, and what to change."""
    fix = {"video": f"or prepare the data once ({command('prepare')}) and train with data.source: prepared",
           "synthetic": "(synthetic clips are rendered on the CPU: each worker needs a core)",
           "prepared": "or move the shards to faster storage"}.get(source, "")
    return (f"the ranks waited for data {100 * fraction:.0f} % of the last log window with "
            f"{plan.num_workers} loader "
            f"workers per rank: raise cpus_per_task (the plan gives a worker per spare core) or set "
            f"data.num_workers {fix}")


def _gpu_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


