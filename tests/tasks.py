"""Small callables the Slurm tests submit (importable on the nodes as tests.tasks)."""

from __future__ import annotations

import functools
import gc
import json
from pathlib import Path
from typing import Any

from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime.checkpoint import Checkpointer


class CrashAfterStart:
    """Marks its start like the trainer does, then fails: a requeue loop with no progress. `varying`: each
    attempt fails differently (so only the no-progress guard, not the repeated-failure one, can stop it)."""

    CAUSES = ("disk", "network", "memory")

    def __init__(self, varying: bool = False) -> None:
        self.varying = varying

    def __call__(self, ctx: Any) -> None:
        ctx.started(Checkpointer(RunFolder(ctx.run_dir).checkpoints).latest_step() or 0)
        # each attempt of the run (a requeue, or a restart inside the allocation) is its own segment
        cause = f" ({self.CAUSES[ctx.segment % len(self.CAUSES)]})" if self.varying else ""
        raise RuntimeError(f"simulated crash right after the restart{cause}")


class StopAtFirstBoundary:
    """Starts at step 0 and, like the trainer, passes its first step boundary."""

    def __call__(self, ctx: Any) -> str:
        ctx.started(0)
        ctx.step_boundary(0, lambda: None)  # nothing trained: the saved state is the one it started from
        ctx.finished(0)
        return "trained"


class ReportsCollector:
    """Writes to `out` (JSON) whether Python's garbage collector is on as the task begins and once its
    `ctx.started` returned, and how many objects are frozen out of its collections by then."""

    def __init__(self, out: str) -> None:
        self.out = out

    def __call__(self, ctx: Any) -> str:
        began = gc.isenabled()
        ctx.started(0)
        report = {"began": began, "started": gc.isenabled(), "frozen": gc.get_freeze_count()}
        Path(self.out).write_text(json.dumps(report))
        ctx.finished(0)
        return "done"


def _save_count(checkpoints: Checkpointer, step: int) -> None:
    checkpoints.save({"step": step}, step)


class CountingTask:
    """The requeue machinery without a model: each step is a short sleep, saved like the trainer saves.

    Resumes from its checkpoint, calls `ctx.step_boundary` at every step, appends every finished step to
    `steps.txt` in the run folder (so a test sees each step once), and finishes at `steps`.
    ignore_warning: drop USR2, as on a site whose time-limit warning never arrives.
    pause_at: at that step, write `paused` in the run folder and wait at the step boundary (still
    handling signals) until a test creates `release` there — so a signal lands while the job runs.
    steps_after_restart: a restarted run finishes that many steps after where it resumed (at most `steps`).
    """

    def __init__(self, steps: int, step_s: float = 0.1, ignore_warning: bool = False,
                 pause_at: int | None = None, steps_after_restart: int | None = None) -> None:
        self.steps, self.step_s, self.ignore_warning, self.pause_at = steps, step_s, ignore_warning, pause_at
        self.steps_after_restart = steps_after_restart

    def __call__(self, ctx: Any) -> int:
        import functools
        import signal
        import time

        if self.ignore_warning:
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        checkpoints = Checkpointer(RunFolder(ctx.run_dir).checkpoints, keep=2)
        step = checkpoints.latest_step() or 0
        ctx.started(step)
        last = self.steps
        if self.steps_after_restart is not None and ctx.env.restart_count > 0:
            last = min(last, step + self.steps_after_restart)
        while step < last:
            ctx.step_boundary(step, functools.partial(_save_count, checkpoints, step))
            if step == self.pause_at and not (ctx.run_dir / "release").exists():
                (ctx.run_dir / "paused").touch()
                time.sleep(0.1)
                continue
            time.sleep(self.step_s)
            step += 1
            with open(ctx.run_dir / "steps.txt", "a") as f:
                f.write(f"{step}\n")
        _save_count(checkpoints, step)
        ctx.finished(step)
        return step


class FailsWhenTold(CountingTask):
    """CountingTask that, in its first attempt, raises at the step boundary after `<run folder>/fail` appears:
    a failure the code may not repeat (a lost connection), when a test decides."""

    def __call__(self, ctx: Any) -> int:
        if ctx.env.restart_count == 0:
            boundary = ctx.step_boundary

            def step_boundary(step: int, save: Any) -> None:
                boundary(step, save)
                if (ctx.run_dir / "fail").exists():
                    raise ConnectionError("the connection to the rendezvous store was reset")

            ctx.step_boundary = step_boundary
        return super().__call__(ctx)


class SlowToLoad(CountingTask):
    """CountingTask whose pickle, in the first attempt, takes until `<gate>/released` exists to load, having
    written `<gate>/loading`: a signal sent meanwhile reaches the job while its task is still starting."""

    def __init__(self, gate: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate

    def __setstate__(self, state: dict[str, Any]) -> None:
        import time
        from pathlib import Path

        self.__dict__.update(state)
        gate = Path(self.gate)
        if not (gate / "released").exists():
            (gate / "loading").touch()
            deadline = time.monotonic() + 120
            while not (gate / "released").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


class NeverPolls:
    """Takes the run context but never reaches a step boundary: it cannot save at a signal."""

    def __call__(self, ctx: Any) -> None:
        import time

        ctx.started(0)
        time.sleep(3600)


def train_with_the_context(name: str, ctx: Any) -> dict:
    """A user's function that builds and runs the trainer itself, handing it the context it got."""
    from taehv_slurm.trainer.task import TrainTask
    from tests.helpers import tiny_train

    train = tiny_train(steps=30, name=name, **{"intervals.log_every": 1})
    return TrainTask(train.to_dict(), {"device": "cpu", "torch_threads": 1})(ctx)


class FailsAtStep:
    """Trains like CountingTask but raises `error` at step `step` of every attempt (a failure that repeats,
    as an out-of-memory error at the same step does)."""

    def __init__(self, step: int, error: str = "CUDA out of memory. Tried to allocate 2.00 GiB") -> None:
        self.step, self.error = step, error

    def __call__(self, ctx: Any) -> int:
        checkpoints = Checkpointer(RunFolder(ctx.run_dir).checkpoints, keep=2)
        step = checkpoints.latest_step() or 0
        ctx.started(step)
        while True:
            ctx.step_boundary(step, functools.partial(_save_count, checkpoints, step))
            if step == self.step:
                raise MemoryError(self.error)
            step += 1
            if step % 2 == 0:
                _save_count(checkpoints, step)


class MeetsAFault:
    """Trains like CountingTask (rank 0 saves every step) and, at `step`, meets a fault from outside its code:
    `ecc` raises what a GPU with an uncorrectable ECC error raises, in the first attempt only (the next one
    finishes `steps`); `disk`, in the first attempt only, writes a cache file into `folder`, a node's own
    disk that is full; `kill` has every rank wait `wait_s` (its watchdog records the step meanwhile), then
    die by SIGKILL, in every attempt (as an out-of-memory kill at the same step repeats)."""

    def __init__(self, fault: str, step: int, steps: int, wait_s: float = 0.0, folder: str = "") -> None:
        self.fault, self.step, self.steps, self.wait_s, self.folder = fault, step, steps, wait_s, folder

    def __call__(self, ctx: Any) -> int:
        import os
        import signal
        import time

        checkpoints = Checkpointer(RunFolder(ctx.run_dir).checkpoints, keep=2)
        step = checkpoints.latest_step() or 0
        ctx.started(step)
        main = ctx.env.rank == 0  # rank 0 saves: the ranks share no process group here
        while step < self.steps:
            save = functools.partial(_save_count, checkpoints, step) if main else lambda: None
            ctx.step_boundary(step, save)
            if step == self.step and self.fault == "ecc" and ctx.env.restart_count == 0:
                raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
            if step == self.step and self.fault == "disk" and ctx.env.restart_count == 0:
                with open(os.path.join(self.folder, f"cache-{ctx.env.rank}.bin"), "wb") as cache:
                    cache.write(b"\0" * 2**20)  # ENOSPC at its flush, naming no file (as buffered writes do)
            if step == self.step and self.fault == "kill":
                time.sleep(self.wait_s)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.1)
            step += 1
            if main:
                _save_count(checkpoints, step)
        ctx.finished(step)
        return step


class SaysWhereItRuns(CountingTask):
    """CountingTask that records, per rank and attempt, what its process sees: whether scontrol is on its
    PATH and whether it runs inside the container tests' image (the marker scripts/setup.sh puts there)."""

    def __call__(self, ctx: Any) -> int:
        import json
        import shutil
        from pathlib import Path

        seen = {"scontrol": shutil.which("scontrol"), "in_image": Path("/etc/taehv-test-image").exists(),
                "slurm_conf": Path("/etc/slurm/slurm.conf").exists()}
        name = f"seen-{ctx.env.rank}-{ctx.env.restart_count}.json"
        (ctx.run_dir / name).write_text(json.dumps(seen))
        return super().__call__(ctx)
