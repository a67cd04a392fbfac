"""The preparation job: decode every video window, encode it with the teacher, store both in shards.

The teacher's encode costs ~4.5× the student's training step per clip (11.8–12.3 vs ~55 clips/s on an H100,
docs/benchmarks.md), so it runs once per window, ahead of training, on every GPU of a job; the
trainer then reads frames and latents together (`taehv_slurm.trainer.prepared.PreparedClips`,
`data.source: prepared`). The folder's window list is `taehv_slurm.trainer.manifest`, its shard files
`taehv_slurm.trainer.shards`.

`PrepareTask` is the callable every rank runs (wrapped in `RequeueableTask` on submission): the ranks
agree on the unfinished shards, take every world_size-th one, and check for signals between shards
(one agreed flag per round); a requeued or resubmitted job skips the finished shards.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taehv_slurm.common.config import RuntimeSettings
from taehv_slurm.common.messages import one_line, rank_logger
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime.signals import ignore_in_worker
from taehv_slurm.trainer.manifest import Manifest, open_clips
from taehv_slurm.trainer.shapes import SPATIAL_FACTOR, TIME_FACTOR
from taehv_slurm.trainer.shards import (
    SHARD_DIR,
    finished_shards,
    remove_stale_temporaries,
    shard_metadata,
    shard_path,
    verify,
    write_shard,
)
from taehv_slurm.trainer.shared_memory import batches, fitted_loader, frames_bytes, in_shared_memory

if TYPE_CHECKING:
    import torch

    from taehv_slurm.runtime.context import RunContext
    from taehv_slurm.trainer.data import VideoFolderClips

log = logging.getLogger("taehv.prepare")


def should_abandon(done: int, total: int, elapsed_s: float, since_signal_s: float, budget_s: float) -> bool:
    """After a signal, with `done` of `total` windows of a shard in `elapsed_s`: abandon it unless
    finishing (with 50 % margin) fits in what is left of `budget_s`. Nothing done yet: abandon."""
    if done <= 0:
        return True
    return elapsed_s / done * (total - done) * 1.5 > budget_s - since_signal_s


class PrepareTask:
    """The picklable callable every rank of a preparation job runs; call with no argument to run here.

    runtime: `ClusterConfig.runtime()` (device, threads, timeouts). batch: clips per teacher call.
    workers: decoding processes per rank (None: cpus_per_task − 1 on GPU, 0 on CPU). compile:
    torch.compile the teacher's encoder (CUDA only; batches are padded to one shape so it compiles once).
    finish_budget_s: after a signal, a shard in progress is finished if that is expected to take less
    than this many seconds, else abandoned (its temporary file removed; the next run redoes it).
    """

    def __init__(self, out: str | os.PathLike, runtime: RuntimeSettings | Mapping[str, Any] | None = None,
                 batch: int = 2, workers: int | None = None, compile: bool = True,
                 finish_budget_s: Mapping[str, float] | None = None) -> None:
        self.out = str(out)
        self.runtime = RuntimeSettings.of(runtime)
        self.batch = int(batch)
        self.workers = workers
        self.compile = bool(compile)
        self.finish_budget_s = dict(finish_budget_s or {"timeout": 50.0, "preempted": 10.0})

    def __call__(self, ctx: RunContext | None = None) -> dict[str, Any]:
        import torch

        from taehv_slurm.runtime.context import RunContext
        from taehv_slurm.runtime.distenv import destroy_distributed, init_distributed

        ctx = ctx or RunContext.standalone(Path(self.out) / "run")
        rank_logger(log.name, ctx.env.rank, every_rank_informs=True)
        choice = self.runtime.device
        use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", ctx.env.local_rank) if use_cuda else torch.device("cpu")
        torch.set_num_threads(self.runtime.torch_threads)
        # gloo even on GPUs: the ranks only agree on a few integers; the teacher needs no collectives.
        init_distributed(ctx.env, "gloo", timeout_s=self.runtime.collective_timeout_s or 3600,
                         rendezvous_timeout_s=self.runtime.rendezvous_timeout_s, use_cuda=use_cuda)
        try:
            return _Worker(self, ctx, device).run()
        finally:
            destroy_distributed()


class _WindowReader:
    """Map-style source for a DataLoader: window id → its frames, or why it could not be decoded."""

    def __init__(self, clips: VideoFolderClips) -> None:
        self.clips = clips

    def __len__(self) -> int:
        return len(self.clips.windows)

    def __getitem__(self, window: int) -> dict[str, Any]:
        try:
            frames = self.clips.read_window(window)
        except Exception as err:  # one bad window never stops a shard: it is recorded as failed
            return {"window": window, "frames": None, "error": one_line(err)[:300]}
        # in a worker, into shared memory here, where a full /dev/shm is an error the loader passes on
        return {"window": window, "frames": in_shared_memory(frames), "error": ""}


class _Worker:
    def __init__(self, task: PrepareTask, ctx: RunContext, device: torch.device) -> None:
        import torch

        self.task, self.ctx, self.device = task, ctx, device
        self.env = ctx.env
        self.out = Path(task.out)
        # Each shard is written (serialised, fsynced, renamed) on a thread while the teacher encodes the next;
        # at most one in flight. With the latents kept on the GPU until a shard is complete (`_encode`), the
        # GPU does not wait for a shard's write.
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self.writing: Future | None = None
        # Each batch's frames are copied to the GPU on a stream of their own while the teacher encodes the
        # previous batch (on the teacher's stream the copy took ~1 % of the loop).
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from taehv_slurm.trainer.speed import use_compile_cache
        from taehv_slurm.trainer.teacher import load_teacher

        ctx, env = self.ctx, self.env
        manifest = Manifest.read(self.out)
        remaining = self._agree_on_remaining(manifest)
        s = manifest.settings
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32  # bf16 convs are slow on CPUs
        # Loaded before ctx.started: a bad teacher fails the job once instead of requeueing it.
        teacher = load_teacher(s["teacher_kind"], s["teacher_path"], s["scaling_factor"],
                               s["seed"]).to(self.device, dtype)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # one input shape throughout: the autotuned kernels pay off
            if self.task.compile:
                use_compile_cache(self.task.runtime.compile_cache_dir)  # every shard job, rank and requeue
                teacher.compile()
        self.teacher = teacher
        clips = open_clips(manifest)
        done_before = manifest.num_shards - len(remaining)
        ctx.started(done_before, shards=manifest.num_shards, remaining=len(remaining),
                    device=str(self.device))
        mine = remaining[env.rank::env.world_size]
        rounds = math.ceil(len(remaining) / env.world_size)
        log.info("rank %d/%d: %d of %d shards left, %d for this rank (%s, batch %d, %s)",
                 env.rank, env.world_size,
                 len(remaining), manifest.num_shards, len(mine), self.device, self.task.batch,
                 "compiled" if self.task.compile and self.device.type == "cuda" else "eager")
        stream = self._stream(clips, [w for shard in mine for w in manifest.shard_windows(shard)])
        written, began = 0, time.perf_counter()
        try:
            for k in range(rounds):
                # One boundary per round (every rank equally often). Finished shards are already saved
                # (each renamed into place whole); at a signal the round's count is what the run keeps.
                ctx.step_boundary(done_before + k * env.world_size,
                                  functools.partial(self._shards_done, done_before, written))
                if env.rank == 0:
                    self._progress(done_before + k * env.world_size, manifest, k * env.world_size, began)
                if k < len(mine) and self._make_shard(manifest, mine[k], stream):
                    written += 1
        finally:
            del stream  # stops the decoding workers
            self.writer.shutdown(wait=True)  # a shard being written is finished (or fails) first
        done = self._shards_done(done_before, written)
        if dist.is_initialized() and env.world_size > 1:
            dist.barrier()  # every shard is renamed into place before rank 0 verifies
        result: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size, "shards_written": written,
                                  "shards_done": done, "shards": manifest.num_shards}
        if env.rank == 0:
            report = verify(self.out)
            log.info("%s", report.table())
            result.update(ok=report.ok, windows_stored=report.windows_stored)
            self._progress(done, manifest, len(remaining), began)
        ctx.finished(done)
        return result

    def _shards_done(self, done_before: int, written: int) -> int:
        """Shards finished by every rank so far (collective), once this rank's last shard is on disk."""
        import torch
        import torch.distributed as dist

        self._wait_for_writer()
        total = torch.tensor([written], dtype=torch.int64)
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_reduce(total)
        return done_before + int(total.item())

    def _agree_on_remaining(self, manifest: Manifest) -> list[int]:
        """Rank 0 lists the unfinished shards and every rank gets the same list (no one has written yet)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.env.rank == 0:
            (self.out / SHARD_DIR).mkdir(exist_ok=True)
            removed = remove_stale_temporaries(self.out, self.env.job_id)
            if removed:
                log.info("removed %d temporary shard file(s) left by an interrupted run", removed)
            done = finished_shards(self.out)
            box[0] = [shard for shard in range(manifest.num_shards) if shard not in done]
        if dist.is_initialized() and self.env.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return list(box[0])

    def _stream(self, clips: VideoFolderClips, windows: list[int]) -> Iterator[dict[str, Any]]:
        """This rank's windows in order, decoded ahead by worker processes while the teacher runs."""
        from torch.utils.data import DataLoader

        cpus = self.task.runtime.cpus_per_task
        workers = self.task.workers
        if workers is None:
            workers = max(1, min(8, cpus - 1)) if self.device.type == "cuda" else 0
        spec = clips.spec
        workers, prefetch = fitted_loader(workers, 4, frames_bytes(spec.frames, spec.height, spec.width),
                                          self.env, log)
        loader = DataLoader(_WindowReader(clips), batch_size=None, sampler=windows, num_workers=workers,
                            pin_memory=self.device.type == "cuda", worker_init_fn=ignore_in_worker,
                            prefetch_factor=prefetch if workers else None)
        return batches(loader)

    def _make_shard(self, manifest: Manifest, shard: int, stream: Iterator[dict[str, Any]]) -> bool:
        """Decode, encode and write one shard; False if a signal made us abandon it."""
        import torch

        windows = manifest.shard_windows(shard)
        frames, latents, stored, failed = [], [], [], []
        pending: list[dict[str, Any]] = []
        began = time.perf_counter()
        for n, window in enumerate(windows):
            if self.ctx.stop.reason and self._abandon(began, n, len(windows)):
                log.info("shard %d abandoned after %d of %d windows (%s): the next run redoes it",
                         shard, n, len(windows), self.ctx.stop.reason)
                return False
            item = next(stream)
            if item["window"] != window:  # the loader yields in sampler order; anything else is a bug
                raise RuntimeError(f"window stream out of order: got {item['window']}, expected {window}")
            if item["frames"] is None:
                failed.append([window, item["error"]])
                log.warning("shard %d: window %d (%s frame %d) not stored: %s", shard, window,
                            *manifest.windows[window], item["error"])
                continue
            pending.append(item)
            if len(pending) == self.task.batch:
                self._encode(pending, frames, latents, stored)
                pending = []
        if pending:
            self._encode(pending, frames, latents, stored)
        t, h, w = manifest.spec
        tensors = {
            "frames": torch.cat(frames) if frames else torch.empty((0, t, 3, h, w), dtype=torch.uint8),
            "latents": torch.cat(latents).cpu() if latents else torch.empty(
                (0, t // TIME_FACTOR, self.teacher.latent_channels, h // SPATIAL_FACTOR, w // SPATIAL_FACTOR),
                dtype=torch.bfloat16),
        }
        meta = shard_metadata(shard, stored, [manifest.windows[w] for w in stored], failed, manifest.spec,
                              time.perf_counter() - began, rank=self.env.rank, job_id=self.env.job_id,
                              teacher=f"{manifest.settings['teacher_kind']} "
                                      f"{manifest.settings['teacher_path']}")
        self._wait_for_writer()
        self.writing = self.writer.submit(self._write, shard, tensors, meta, began, len(stored), len(failed))
        return True

    def _write(self, shard: int, tensors: dict[str, Any], meta: dict[str, str], began: float, windows: int,
               failed: int) -> None:
        """On the writer thread: the shard file, then its event."""
        write_shard(shard_path(self.out, shard), tensors, meta, tag=self.env.job_id)
        seconds = time.perf_counter() - began
        self.ctx.events.write("shard", shard=shard, rank=self.env.rank, segment=self.ctx.segment,
                              job_id=self.env.job_id, windows=windows, failed=failed,
                              seconds=round(seconds, 4))
        log.info("shard %d: %d windows (%d failed) in %.2f s", shard, windows, failed, seconds)

    def _wait_for_writer(self) -> None:
        """Until the shard being written is on disk; its error, if any, is raised here."""
        if self.writing is not None:
            writing, self.writing = self.writing, None
            writing.result()

    def _encode(self, items: list[dict[str, Any]], frames: list, latents: list, stored: list) -> None:
        import torch

        # uint8 B×T×3×H×W; on GPUs each window is copied from its pinned loader buffer without waiting (on the
        # copy stream), and the latents stay on the GPU until the shard is complete: the host does not wait
        # for the teacher between batches, so it queues the next batch while the GPU encodes this one.
        with torch.cuda.stream(self.copy_stream):  # no-op without one (CPU)
            x = torch.stack([item["frames"].to(self.device, non_blocking=True) for item in items])
        if self.copy_stream:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            x.record_stream(compute)  # made on the copy stream: not reused before the teacher is done with it
        if self.task.compile and self.device.type == "cuda" and len(items) < self.task.batch:
            # one shape for the compiled encoder: pad a short last batch with copies of its last clip
            x = torch.cat([x, x[-1:].expand(self.task.batch - len(items), *x.shape[1:])])
        # Teacher.latents is the trainer's own path: it encodes frames[:, :4L-3] (teacher_frame_count)
        latents.append(self.teacher.latents(x)[: len(items)].to(torch.bfloat16))
        frames.append(torch.stack([item["frames"] for item in items]))
        stored.extend(int(item["window"]) for item in items)

    def _abandon(self, began: float, done: int, total: int) -> bool:
        stop = self.ctx.stop
        return should_abandon(done, total, time.perf_counter() - began,
                              time.time() - (stop.signal_time or time.time()),
                              self.task.finish_budget_s.get(stop.reason or "preempted", 10.0))

    def _progress(self, done: int, manifest: Manifest, processed: int, began: float) -> None:
        """Rank 0's progress line in the run's metrics, so `taehv status` and `JobHandle.wait` show shards
        done."""
        elapsed = time.perf_counter() - began
        row = {"step": done, "time": time.time(), "shards": manifest.num_shards,
               "shards_per_second": processed / elapsed if elapsed > 0 and processed else None}
        RunFolder(self.ctx.run_dir).metrics().append(row)
