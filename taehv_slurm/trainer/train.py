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

import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from taehv_slurm.common.config import RuntimeSettings, TrainConfig, load_train
from taehv_slurm.common.messages import command, rank_logger
from taehv_slurm.common.plan import ScalePlan, plan_for
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime import network
from taehv_slurm.runtime.checkpoint import Checkpointer, CheckpointError, nonfinite_tensors
from taehv_slurm.runtime.context import FatalTaskError, RunContext
from taehv_slurm.runtime.distenv import DistEnv, destroy_distributed, init_distributed
from taehv_slurm.runtime.ranks import node_name
from taehv_slurm.trainer.build import (
    build_sources,
    check_compatible,
    configure_backends,
    data_wait_advice,
    device_for,
    gpu_memory_gb,
)
from taehv_slurm.trainer.data import GlobalOrder, microbatches
from taehv_slurm.trainer.divergence import DivergenceGuard
from taehv_slurm.trainer.engine import Engine, Microbatch, make_engine
from taehv_slurm.trainer.layers import FAST_PATHS
from taehv_slurm.trainer.losses import DistillModule
from taehv_slurm.trainer.metrics import LogWindow, MetricsWriter, sample_grid
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, init_for_training, load_published_weights
from taehv_slurm.trainer.rng import get_rng_state, seed_all, set_rng_state
from taehv_slurm.trainer.schedule import lr_at
from taehv_slurm.trainer.shared_memory import BATCH_MARGIN, fitted_loader, frames_bytes
from taehv_slurm.trainer.speed import mfu, model_flops_per_clip, peak_flops, use_compile_cache
from taehv_slurm.trainer.stragglers import DEFAULT_MARGIN, WARMUP_STEPS, HeldOff, SlowRanks, StepClock
from taehv_slurm.trainer.teacher import load_teacher, to_unit
from taehv_slurm.trainer.trackers import Trackers

log = logging.getLogger("taehv")
DATA_WAIT_WARN = 0.10  # warn once when the ranks wait for data longer than this fraction of a log window


class DivergedError(FatalTaskError):
    """The run diverged past its budget (or its state is not finite): it stops; the message says what next."""


class SaveFailedError(FatalTaskError):
    """A save the run's folder refuses whoever retries it (full, over quota, read-only): the run stops."""


def run_training(train: Mapping[str, Any], rt: RuntimeSettings, ctx: RunContext | None) -> dict[str, Any]:
    """What `TrainTask` runs on every rank: settings → process group → `Trainer.run` → teardown."""
    cfg = load_train(train)
    ctx = ctx or RunContext.standalone(rt.run_dir or Path("runs") / cfg.name)
    env = ctx.env
    rank_logger(log.name, env.rank)  # our logger only: submitit logs through its own handler
    device = device_for(rt.device, env)
    configure_backends(device)
    torch.set_num_threads(rt.torch_threads)
    plan = plan_for(env.num_nodes, env.local_world_size, cfg, gpu_memory_gb=rt.gpu_memory_gb,
                    cpus_per_task=rt.cpus_per_task, device=device.type)
    for key, value in plan.nccl_env.items():
        os.environ.setdefault(key, value)
    backend = init_distributed(env, rt.dist_backend, timeout_s=rt.collective_timeout_s or plan.nccl_timeout_s,
                               rendezvous_timeout_s=rt.rendezvous_timeout_s, use_cuda=device.type == "cuda")
    net = network.transport(backend, env.world_size, env.num_nodes)
    if env.rank == 0 and env.num_nodes > 1:  # within one node the attempt's record is enough
        log.info("network between the ranks: %s", network.describe(net))
    if env.local_rank == 0 and (warning := network.warning(net, network.infiniband_devices())):
        log.warning(warning)
    if device.type == "cuda":  # what NCCL runs with: the plan's settings, the cluster's env and the site's
        nccl = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_"))]
        log.info("NCCL settings: %s", " ".join(nccl) or "NCCL's defaults")
    try:
        trainer = Trainer(cfg, plan, env, device, ctx, rt, net)
        try:
            return trainer.run()
        finally:
            trainer.close()
    finally:
        destroy_distributed()


class Trainer:
    def __init__(self, cfg: TrainConfig, plan: ScalePlan, env: DistEnv, device: torch.device,
                 ctx: RunContext, runtime: RuntimeSettings | None = None,
                 network: dict[str, Any] | None = None) -> None:
        self.cfg, self.plan, self.env, self.device, self.ctx = cfg, plan, env, device, ctx
        self.network = network
        self.runtime = runtime or RuntimeSettings()
        self.run_dir = ctx.run_dir
        self.main = env.rank == 0
        self.copy_stream = (torch.cuda.Stream(device) if device.type == "cuda" and FAST_PATHS["copy_overlap"]
                            else None)
        self.step_samples: list[int] = []  # this rank's clip indices of the current step (record_samples)
        self.data_offset = 0  # optimizer steps of data passed by rollbacks (saved with each checkpoint)
        self.rollbacks = 0
        self.checkpoints = Checkpointer(RunFolder(self.run_dir).checkpoints,
                                        keep=cfg.intervals.keep_checkpoints,
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
        student = TAEHV(TAEHVConfig.from_dict(cfg.model_fields()))
        if cfg.model.init_from:
            load_published_weights(student, cfg.model.init_from)
        else:
            init_for_training(student)
        student.to(self.device)
        if cfg.engine.channels_last and self.device.type == "cuda":
            student.to(memory_format=torch.channels_last)
        module = DistillModule(student, cfg.loss.latent_weight, cfg.loss.reconstruction_weight,
                               cfg.loss.decoder_weight)
        self.peak_flops = peak_flops(self.device, plan.precision)
        self.flops_per_clip = (model_flops_per_clip(module, cfg.data.frames, cfg.data.height, cfg.data.width,
                                                    self.device, cfg.model.latent_channels,
                                                    self.runtime.compile_cache_dir)
                               if self.peak_flops else 0.0)
        if cfg.engine.compile and self.device.type == "cuda":
            use_compile_cache(self.runtime.compile_cache_dir)
        self.engine: Engine = make_engine(
            plan.engine, module, self.device, precision=plan.precision, grad_clip=cfg.optim.grad_clip,
            lr=plan.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
            compile=cfg.engine.compile and self.device.type == "cuda", compile_mode=cfg.engine.compile_mode,
            per_gpu_batch=plan.per_gpu_batch, grad_accum=plan.grad_accum,
        )
        # each step timed for the slow-rank naming; slow_rank_windows 0: no clock at all (the A/B's "off")
        self.timed = self.engine.timed and self.runtime.slow_rank_windows > 0
        self.held_off = HeldOff() if self.timed else None

    def resume(self) -> int:
        """Rank 0 chooses the checkpoint to resume — the newest that loads; damaged ones are moved aside,
        each named in the log and in the run's events — and every rank loads that one (so no rank ever reads
        a folder another rank is moving)."""
        loaded = self.checkpoints.load_latest() if self.main else None
        for line in self.checkpoints.moved_aside:
            log.warning(line)
            self.ctx.events.write("checkpoint_damaged", segment=self.ctx.segment, detail=line,
                                  job_id=self.env.job_id)
        step = from_rank0(loaded[0] if loaded else None)
        if step is None:
            return 0
        step, state, meta = loaded if loaded else self.checkpoints.load(step)
        check_compatible(meta, self.cfg, self.checkpoints.directory / f"step_{step:08d}")
        self.engine.load_full_state(state)
        self.data_offset = int(meta.get("data_offset_steps", 0))
        self.rollbacks = int(meta.get("rollbacks", 0))
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
        step = self.resumed_at = self.resume()
        ctx.started(step, config=cfg.to_dict(), engine=plan.engine, effective_batch=plan.effective_batch,
                    grad_accum=plan.grad_accum, network=self.network)
        if self.main:
            log.info("plan for %d ranks:\n%s", env.world_size, plan.table())
        tracked = self.main and (cfg.tracking.wandb or cfg.tracking.mlflow)
        self.metrics = MetricsWriter(self.run_dir, step, enabled=self.main, total=cfg.steps,
                                     trackers=Trackers(cfg.tracking, self.run_dir, self.run_dir.name,
                                                       cfg.to_dict()) if tracked else None)
        self.guard = DivergenceGuard(cfg.divergence, self.device, self.rollbacks)
        margin = self.runtime.slow_rank_margin
        if margin is None:
            margin = DEFAULT_MARGIN.get(self.device.type, DEFAULT_MARGIN["cpu"])
        self.slow = SlowRanks(all_hosts(), margin, self.runtime.slow_rank_windows,
                              "GPU" if self.device.type == "cuda" else "compute")
        sizes = plan.microbatch_sizes(env.rank)
        self.stream = self.open_stream(step, sizes)
        window = LogWindow(self.device)
        if step >= cfg.steps and self.main:
            log.warning("nothing to train: the checkpoint is at step %d and steps is %d; "
                        "submit with a higher --set steps=N to train on", step, cfg.steps)
        last: dict[str, Any] = {}
        compiled: list[str] = []  # how the student ran so far (precompile.py): logged where it changes
        while step < cfg.steps:
            clock = StepClock(self.device) if self.timed else None
            with clock.collective() if clock is not None else contextlib.nullcontext():  # the stop agreement
                ctx.step_boundary(step, functools.partial(self.save_at_signal, step), self.device)
            lr = lr_at(step, plan.lr, plan.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio)
            result = self.engine.train_step(self.step_microbatches(sizes, window, clock), lr, clock)
            window.add(result, clock)
            decision = self.guard.observe(step, result.skipped)
            step += 1
            # at the first step, and at the step where a shape compiled aside takes over from eager
            if self.main and (how := self.engine.compiled_outcomes()) != compiled:
                compiled = how
                log.info("the compiled student at step %d: %s", step, ", ".join(how))
                self.ctx.events.write("compiled", segment=self.ctx.segment, step=step, student=how)
            last = self.after_step(step, window, lr) or last
            if step == cfg.steps and decision is None:
                decision = self.guard.flush()  # the last step's flag, before the final save
            if decision is not None:
                step = self.diverged(decision, step, sizes)
        if step > self.resumed_at:  # a run resumed at its last step keeps its checkpoint as it is
            self.save(step, blocking=True)
        self.metrics.close(finished=True)
        ctx.finished(step)
        return {"step": step, "rank": env.rank, "world_size": env.world_size, "engine": plan.engine,
                **{k: last.get(k) for k in ("loss", "psnr", "reconstruction_loss", "latent_loss")},
                "skipped_steps": self.guard.total,
                "checkpoint": str(self.checkpoints.directory / f"step_{step:08d}")}

    def after_step(self, step: int, window: LogWindow, lr: float) -> dict[str, Any] | None:
        """After optimizer step `step` (1-based): the sample record, the log line, validation and the
        periodic checkpoint, each at its interval. Returns the log line's values when it wrote one."""
        cfg, plan = self.cfg, self.plan
        if cfg.intervals.record_samples:
            self.metrics.write_samples(step, self.gather_samples())
        last = None
        if step % plan.log_every == 0 or step == cfg.steps or step == 1:
            judged = step - plan.log_every >= self.resumed_at + WARMUP_STEPS  # a window past the warm-up
            last = {**self.slow_ranks(window.timings(), judged), **window.close(plan.effective_batch),
                    "lr": lr, "gpu_memory_gb": gpu_memory_gb(self.device)}
            last["mfu"] = mfu(last["samples_per_second"] / self.env.world_size, self.flops_per_clip,
                              self.peak_flops)
            self.metrics.write(step, last)
            if self.main and step > 1 and last["data_wait"] > DATA_WAIT_WARN and not window.warned:
                log.warning(data_wait_advice(last["data_wait"], plan, cfg.data.source))
                window.warned = True
        if step % plan.val_every == 0 or step == cfg.steps:
            with self.ctx.section("validate"):  # the watchdog times a validation apart from a step
                self.metrics.write(step, self.validate(), prefix="val")
                if cfg.tracking.sample_frames:
                    self.metrics.write_image(step, "val/sample", self.sample_image())
        # Not while steps are being skipped: a rollback needs the checkpoints from before them.
        if step % plan.ckpt_every == 0 and step < cfg.steps and not self.guard.consecutive:
            self.save(step, blocking=not cfg.intervals.async_checkpoint)
        return last

    def slow_ranks(self, figures: list[list[float]] | None, judged: bool) -> dict[str, Any]:
        """The log line's timing fields (stragglers.py) and, on rank 0, the log lines and events of the ranks
        newly named slow or no longer slow (none while `judged` is False: the warm-up)."""
        if figures is None:
            return {}
        fields, new, recovered = self.slow.observe(figures, judged)
        if self.main:
            hosts = self.slow.hosts
            for latest in new:
                log.warning("slow rank: %s", latest.detail)
                self.ctx.events.write("slow_rank", segment=self.ctx.segment, rank=latest.rank,
                                      host=None if latest.rank is None else hosts[latest.rank],
                                      cause=latest.cause, lost_s=round(latest.lost_s, 4),
                                      detail=latest.detail, step=self.ctx.step, job_id=self.env.job_id)
            for rank in recovered:
                who = "the link" if rank is None else f"rank {rank} on {hosts[rank]}"
                log.info("%s is no longer slow", who)
                self.ctx.events.write("slow_rank_recovered", segment=self.ctx.segment, rank=rank,
                                      host=None if rank is None else hosts[rank], step=self.ctx.step,
                                      job_id=self.env.job_id)
        return fields

    def open_stream(self, step: int, sizes: list[int]) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches from optimizer step `step` on, past the batches rollbacks skipped."""
        plan, cfg, env = self.plan, self.cfg, self.env
        batch = max(sizes) * frames_bytes(cfg.data.frames, cfg.data.height, cfg.data.width) * BATCH_MARGIN
        workers, prefetch = fitted_loader(plan.num_workers, plan.prefetch_factor, batch, env, log)
        return microbatches(self.train_source, GlobalOrder(len(self.train_source), cfg.seed),
                            step + self.data_offset, plan.effective_batch, plan.first_sample(env.rank), sizes,
                            workers, prefetch, pin_memory=self.device.type == "cuda")

    def close(self) -> None:
        """Stops the loader's workers, however the run ended. Not left to the garbage collector: the
        trainer is made before its start is over, so it is frozen out of every collection
        (taehv_slurm/runtime/collector.py), and the workers, which ignore SIGTERM, would hold the process's
        exit."""
        if (stream := getattr(self, "stream", None)) is not None:
            stream.close()

    def save_at_signal(self, step: int) -> None:
        self.save(step, blocking=True)
        self.metrics.close()

    # ------------------------------------------------------------------------------ divergence
    def diverged(self, decision: str, step: int, sizes: list[int]) -> int:
        """The divergence budget is spent at optimizer step `step`: roll back (returns the restored step)
        or stop the run (DivergedError on every rank: FAILED, one line, no requeue)."""
        if decision == "rollback" and (restored := self.rollback(step, sizes)) is not None:
            return restored
        latest = self.checkpoints.latest_step()
        folder = self.checkpoints.directory / f"step_{latest or 0:08d}"
        where = (f"the last checkpoint is step {latest} ({folder}), and resubmitting resumes from it"
                 if latest is not None else
                 "no checkpoint was saved yet, so resubmitting starts from step 0")
        tried = (f" (rolled back {self.rollbacks} time(s) already)" if self.rollbacks
                 else " (divergence.action: rollback retries from the checkpoint by itself)")
        raise DivergedError(
            f"step {step}: the loss or gradient norm {self.guard.spent()}; no such update was applied, so "
            f"the weights stay finite; {where}: lower optim.lr (now {self.cfg.optim.lr:g}) or lengthen "
            f"optim.warmup_steps (now {self.cfg.optim.warmup_steps}), then {command('submit')} --name "
            f"{self.run_dir.name}{tried}")

    def rollback(self, step: int, sizes: list[int]) -> int | None:
        """Restore the newest checkpoint from before the skipped steps on every rank and pass the batches
        trained since it; None when there is no such checkpoint."""
        first_bad = self.guard.first_bad_step or 0
        before = [s for s in self.checkpoints.steps() if s <= first_bad] if self.main else []
        back = from_rank0(before[-1] if before else None)
        if back is None:
            return None
        _, state, _ = self.checkpoints.load(back)
        self.engine.load_full_state(state)
        self.data_offset += step - back
        self.rollbacks += 1
        self.guard.rolled_back()
        self.close()  # stops its loader workers
        self.stream = self.open_stream(back, sizes)
        self.metrics.rewind(back)
        if self.main:
            log.warning("rolled back from step %d to the checkpoint of step %d, passing the %d batches since "
                        "(rollback %d of divergence.max_rollbacks=%d)", step, back, step - back,
                        self.rollbacks, self.cfg.divergence.max_rollbacks)
            self.ctx.events.write("rollback", segment=self.ctx.segment, from_step=step, to_step=back,
                                  skipped_batches=step - back, rollbacks=self.rollbacks,
                                  job_id=self.env.job_id)
        self.save(back, blocking=True)  # the checkpoint records the batches to pass: a requeue keeps them
        return back

    def step_microbatches(self, sizes: list[int], window: LogWindow,
                          clock: StepClock | None = None) -> Iterator[Microbatch]:
        """This rank's micro-batches of one step, pulled from the loader one at a time (the GPU works on
        one while the next is loaded), each weighted by its share of the effective batch."""
        self.step_samples.clear()
        for size in sizes:
            began, cpu = time.perf_counter(), time.thread_time()
            # a rank stuck reading is named so by a hang's verdict; this process held off the CPU while it
            # waited is not its loader's doing (stragglers.HeldOff)
            watch = self.held_off.watch() if self.held_off else contextlib.nullcontext(lambda: 0.0)
            with self.ctx.section("data"), watch as held:
                batch = next(self.stream)
            waited, held_s = time.perf_counter() - began, held()
            window.data_wait_s += waited - held_s  # the loader's part
            if clock is not None:
                clock.data(waited, time.thread_time() - cpu, held_s)
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
        """The batch's frames and latents on the device. On a GPU they are copied on a stream of their own
        (`FAST_PATHS["copy_overlap"]`): the host queues the copy while the GPU still computes the micro-batch
        before, so it overlaps that work instead of waiting behind it (50 MB of frames a micro-batch)."""
        with torch.cuda.stream(self.copy_stream):  # no-op without one
            frames = batch["frames"].to(self.device, non_blocking=True)
            latents = batch["latents"].to(self.device, non_blocking=True) if "latents" in batch else None
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            for tensor in (frames, latents):
                if tensor is not None:
                    tensor.record_stream(compute)  # made on the copy stream, used on this one
        if latents is None and self.teacher is not None:
            latents = self.teacher.latents(frames)
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

    def sample_image(self) -> np.ndarray | None:
        """Rank 0: validation clip 0's frames above the student's reconstruction (every rank runs the
        forward: ZeRO-3 gathers weights in it); None on the other ranks."""
        frames = self.val_source[0]["frames"].to(self.device)
        decoded = self.engine.reconstruct(frames.unsqueeze(0))[0]
        return sample_grid(to_unit(frames), decoded, self.cfg.tracking.sample_frames) if self.main else None

    def save(self, step: int, blocking: bool) -> None:
        """Every rank takes part (ZeRO-3 gathers; RNG states are gathered); rank 0 writes. A state with a
        non-finite value is never written: every rank stops (the last checkpoint stays `latest`)."""
        with self.ctx.section("save"):  # timed by the watchdog as a save, not as a step
            self._save(step, blocking)

    def _save(self, step: int, blocking: bool) -> None:
        start = time.perf_counter()
        state = self.engine.full_state()
        rngs: list[Any] = [None] * self.env.world_size
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_gather_object(rngs, get_rng_state())
        else:
            rngs = [get_rng_state()]
        bad = from_rank0(nonfinite_tensors(state) if self.main else None)
        if bad:
            raise DivergedError(f"step {step}: the model state holds non-finite values ({len(bad)} "
                                f"tensor(s), e.g. {bad[0]}); it was not saved, the last checkpoint stays "
                                f"latest: lower optim.lr (now {self.cfg.optim.lr:g}) or lengthen "
                                "optim.warmup_steps, then resubmit")
        failed = None
        if self.main:
            state = {**state, "rng": rngs, "step": step}
            meta = {"world_size": self.env.world_size, "engine": self.plan.engine,
                    "model": self.cfg.model_fields(),
                    "config": self.cfg.to_dict(), "plan": self.plan.to_dict(), "host": socket.gethostname(),
                    "data_position": (step + self.data_offset) * self.plan.effective_batch,
                    "data_offset_steps": self.data_offset, "rollbacks": self.rollbacks}
            try:  # full_state() already copied everything off the GPU: the writer thread owns its tensors
                self.checkpoints.save(state, step, meta, blocking=blocking)  # raises an earlier one's error
                if blocking:
                    self.checkpoints.wait()
            except CheckpointError as err:
                failed = (str(err), err.lasting)
        failed = from_rank0(failed)  # every rank waits for the save (a barrier), and stops alike if it failed
        if failed:  # a full, read-only or forbidden folder stops the run: a restart would fail the same way
            raise (SaveFailedError if failed[1] else CheckpointError)(failed[0])
        if self.main:
            seconds = time.perf_counter() - start
            log.info("checkpoint step %d %s in %.2f s", step, "saved" if blocking else "handed to the writer",
                     seconds)
            self.ctx.events.write("checkpoint", segment=self.ctx.segment, step=step,
                                  seconds=round(seconds, 3), blocking=blocking, job_id=self.env.job_id)


def all_hosts() -> list[str]:
    """Every rank's node name, by rank (collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [node_name()]
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, node_name())
    return hosts


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (one decision for all; collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------------------ helpers
