"""Following runs to their end, as `taehv submit --local/--follow` does.

One run: rank 0's log as it grows (each traceback as one line naming the log that holds it) and, in a
terminal, one bar line under it — step/total, clips/s, ETA, loss, PSNR, requeues — read from the run's
metrics (a rank's stdout is never a terminal under a scheduler). Several runs (a sweep): a line
per run whenever its state or step moves. Then the end: the state, and for a finished run a summary
with the final PSNR, the wall time, the requeues, where the checkpoints, metrics and TensorBoard files
are, and the export command; for a failure the error once and where its traceback is.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from taehv_slurm.cli.conventions import EXIT_DONE, EXIT_FAILED, stop_signal, stopped_exit_code
from taehv_slurm.common.messages import command
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.goodput import summary as goodput_summary
from taehv_slurm.handle import JobHandle
from taehv_slurm.logfollow import LogFollower
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.slurm import is_final, is_success

# What the CLI says when Ctrl-C or a SIGTERM stops a job of this machine: (what it heard, how to end the job
# at once without saving).
STOP_WORDS = {signal.SIGINT: ("interrupted", "Ctrl-C again"),
              signal.SIGTERM: ("terminated (SIGTERM)", "a second SIGTERM")}


class MetricsTail:
    """The newest train and validation rows of a run's metrics, read incrementally (the file only
    grows, except when a resumed run drops the lines past its checkpoint: then it is read again)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunFolder(run_dir).metrics().path
        self.position = 0
        self.first: dict[str, Any] | None = None
        self.train: dict[str, Any] | None = None
        self.val: dict[str, Any] | None = None

    def poll(self) -> MetricsTail:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.position:
                    self.position, self.first, self.train, self.val = 0, None, None, None
                f.seek(self.position)
                data = f.read()
        except FileNotFoundError:
            return self
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self.position += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in row:
                self.first = self.first or row
                self.train = row
            elif "val_loss" in row or "val_psnr" in row:
                self.val = row
        return self


def progress_line(handle: JobHandle, state: str, tail: MetricsTail, requeues: int, width: int = 120) -> str:
    """'job 123 RUNNING [######----] 120/400 · 35.2 clips/s · ETA 1:05 · loss 0.0123 · psnr 21.3 dB'.
    Fitted to `width`: the bar narrows, then the rate, the ETA and the bar go, before loss and PSNR do."""
    total, row = handle.total_steps, tail.train or {}
    step = int(row.get("step", 0))
    eta, rate = _eta_s(tail, total), row.get("samples_per_second")
    # (text, the order in which it goes when the line is too wide: higher first; 0 stays)
    fields: list[tuple[str, int]] = [(f"job {handle.job_id} {state}", 0)]
    if total:
        fields.append((f"{step}/{total}", 0))
    fields += [(f"{rate:.1f} clips/s", 4)] if rate else []
    fields += [(f"ETA {_clock(eta)}", 3)] if eta is not None else []
    fields += [(f"loss {row['loss']:.4g}", 1)] if "loss" in row else []
    fields += [(f"psnr {row['psnr']:.1f} dB", 1)] if row.get("psnr") is not None else []
    fields += [(f"requeued {requeues}×", 2)] if requeues else []
    line = ""
    # (bar cells, drop fields of this rank and above), tried in turn until the line fits
    for cells, drop in ((20, 99), (10, 99), (10, 4), (10, 3), (0, 3), (0, 2), (0, 1)):
        kept = [text for text, rank in fields if rank < drop]
        if total and cells:
            filled = int(cells * min(step, total) / total)
            kept[1] = f"[{'#' * filled}{'-' * (cells - filled)}] {kept[1]}"
        line = " · ".join(kept)
        if len(line) <= width:
            return line
    return line[:width]


def _eta_s(tail: MetricsTail, total: int | None) -> float | None:
    """Seconds left at the pace since the first row this run segment logged."""
    first, last = tail.first, tail.train
    if not (total and first and last) or last["step"] <= first["step"]:
        return None
    pace = (last["time"] - first["time"]) / (last["step"] - first["step"])
    return max(0.0, (total - last["step"]) * pace)


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds + 0.5), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"


class _Bar:
    """The bar line under the streamed log in a terminal: log text is written above it, then it is redrawn."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.text = out, ""

    def write(self, text: str) -> None:
        if text:
            self.out.write("\r\x1b[2K" + text + ("" if text.endswith("\n") else "\n"))
            self.draw(self.text)

    def flush(self) -> None:
        self.out.flush()

    def draw(self, text: str) -> None:
        self.text = text
        self.out.write("\r\x1b[2K" + text)
        self.out.flush()

    def close(self) -> None:
        if self.text:
            self.out.write("\n")
            self.out.flush()


def follow_to_the_end(handle: JobHandle, stop_on_interrupt: bool, out: TextIO | None = None,
                      bar: bool | None = None) -> tuple[str, int | None]:
    """Stream rank 0's log (with the bar line in a terminal, or with bar=True) until the job ends:
    (final state, the signal that stopped following — SIGINT for Ctrl-C, SIGTERM — or None).

    Ctrl-C (or a SIGTERM, see common.terminate_as_interrupt) on a job of this machine stops it as a
    preemption would: every rank saves at its next step, then the job ends CANCELLED (a second one ends it
    without waiting). On a cluster it only stops following; the job runs on."""
    out = out or sys.stdout
    follower = LogFollower(handle, rank=0, hide_tracebacks=True)
    live = _Bar(out) if (out.isatty() if bar is None else bar) else None
    tail = MetricsTail(handle.run_dir)

    def run() -> str:
        if live is None:
            return follower.run(out)
        while True:
            state = follower.step(live)  # type: ignore[arg-type]  # write() and flush() are all it uses
            width = shutil.get_terminal_size().columns - 1  # each time: the terminal may have been resized
            live.draw(progress_line(handle, state, tail.poll(), len(handle.interruptions()), width))
            if is_final(state):
                live.close()
                return state
            time.sleep(1.0)

    try:
        return run(), None
    except KeyboardInterrupt as stop:
        signum = stop_signal(stop)
        if live is not None:
            live.close()
        if not stop_on_interrupt:
            print(f"\nstopped following; job {handle.job_id} runs on "
                  f"({command('logs')} {handle.job_id} --follow)",
                  file=out)
            return handle.state, signum
    heard, again = STOP_WORDS[signum]
    print(f"\n{heard}: every rank saves at its next step, then job {handle.job_id} ends "
          f"({again} to end it without saving)", file=out, flush=True)
    handle.cancel()
    try:
        return run(), signum
    except KeyboardInterrupt:
        handle.cancel()  # a second stop signal: the controller ends the ranks at once
        return follower.run(out), signum


def follow_all(handles: Sequence[JobHandle], stop_on_interrupt: bool, out: TextIO | None = None,
               poll_s: float = 2.0, every_s: float = 30.0) -> tuple[list[str], int | None]:
    """Several runs (a sweep) until every one has ended: a line per run when its state changes, and
    at most every `every_s` seconds while its step moves. Returns (final states, the signal that stopped
    following or None). The states of all the runs are one question to Slurm a poll, and the polls grow
    apart while no state changes (`JobHandle.wait`'s rhythm)."""
    out = out or sys.stdout
    shown: dict[str, tuple[str, float]] = {}  # job id → (state, when a line was last printed)
    tails = {h.job_id: MetricsTail(h.run_dir) for h in handles}
    backoff = handles[0].backoff(poll_s)
    stopped: int | None = None
    states: list[str] = []
    while True:
        try:
            before, states = states, [h.state for h in handles]
            for handle, state in zip(handles, states):
                last_state, when = shown.get(handle.job_id, ("", 0.0))
                if state != last_state or (not is_final(state) and time.monotonic() - when >= every_s):
                    line = progress_line(handle, state, tails[handle.job_id].poll(),
                                         len(handle.interruptions()))
                    print(f"{handle.name}: {line}", file=out, flush=True)
                    shown[handle.job_id] = (state, time.monotonic())
            if all(is_final(s) for s in states):
                return states, stopped
            time.sleep(backoff.after(states != before))
        except KeyboardInterrupt as stop:
            if stopped is not None or not stop_on_interrupt:
                if not stop_on_interrupt:
                    print(f"\nstopped following; the runs go on ({command('status')})", file=out)
                    return [h.state for h in handles], stop_signal(stop)
                for handle in handles:
                    handle.cancel()  # a second stop: the controllers end their ranks at once
                continue
            stopped = stop_signal(stop)
            heard, again = STOP_WORDS[stopped]
            print(f"\n{heard}: every run saves at its next step, then ends "
                  f"({again} to end them without saving)", file=out, flush=True)
            for handle in handles:
                handle.cancel()


def report_end(handle: JobHandle, state: str, stopped: int | None, out: TextIO | None = None,
               err: TextIO | None = None) -> None:
    """The job's end: its state, then for a finished run the summary (`summary_lines`), for a failure
    the error once and where the traceback is, for a stop where it was saved and how to resume."""
    out, err = out or sys.stdout, err or sys.stderr
    print(f"job {handle.job_id} ended: {state}", file=out)
    if is_success(state):
        print("\n".join(summary_lines(handle)), file=out)
        return
    if state.startswith("CANCELLED") or stopped is not None:
        saved = [e["step"] for e in handle.events() if e["event"] in ("cancelled", "requeue")]
        where = f"saved at step {saved[-1]}" if saved else "stopped before it saved a step"
        print(f"{where}; resume with: {command('submit')} --name {handle.name} and the same flags", file=err)
        return
    print(failure_line(handle, state), file=err)


def failure_line(handle: JobHandle, state: str) -> str:
    """`error: <the failing rank's error>; full traceback: <its log>` for a job that ended `state`."""
    return (f"error: {handle.error or 'the job ended ' + state}; "
            f"full traceback: {handle.log_path(handle.failed_rank or 0)}")


def summary_lines(handle: JobHandle) -> list[str]:
    """What a finished run leaves: final PSNR, steps, wall time, requeues, its files, the export command."""
    tail = MetricsTail(handle.run_dir).poll()
    events = handle.events()
    starts = [e["time"] for e in events if e["event"] == "start"]
    ends = [e["time"] for e in events if e["event"] in ("finished", "stopped")]
    train, val = tail.train or {}, tail.val or {}
    lines = []
    scores = []
    if train.get("psnr") is not None:
        scores.append(f"train PSNR {train['psnr']:.2f} dB (loss {train['loss']:.4g})")
    if val.get("val_psnr") is not None:
        scores.append(f"validation PSNR {val['val_psnr']:.2f} dB at step {val['step']}")
    if scores:
        lines.append("final: " + ", ".join(scores))
    wall = f", {_clock(ends[-1] - starts[0])} wall" if starts and ends else ""
    rate = f", last {train['samples_per_second']:.1f} clips/s" if train.get("samples_per_second") else ""
    requeues = len(handle.interruptions())
    lines.append(f"steps: {train.get('step', '-')}/{handle.total_steps or '?'}{wall}{rate}, "
                 f"requeued {requeues}×")
    if "train" in handle.record:
        lines.append(goodput_summary(handle.goodput()))
    run = RunFolder(handle.run_dir)
    latest = Checkpointer(run.checkpoints).latest_step()
    if latest is not None:
        lines.append(f"checkpoint:  {run.checkpoints / f'step_{latest:08d}'}")
    lines.append(f"metrics:     {run.metrics().path} (JobHandle.metrics() reads it as a DataFrame)")
    if (run.path / "tb").is_dir():
        lines.append(f"tensorboard: tensorboard --logdir {run.path / 'tb'}")
    if latest is not None and "train" in handle.record:
        lines.append(f"export:      {command('export')} {run.path} --out {run.export}")
    return lines


def report_all(handles: Sequence[JobHandle], states: Sequence[str], stopped: int | None,
               out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The end of several runs: one status table, each failure's error once; the exit code (0 when every
    run completed, 130 or 143 when Ctrl-C or a SIGTERM stopped them, else 1)."""
    from taehv_slurm.runs import status_table

    out, err = out or sys.stdout, err or sys.stderr
    print(status_table(handles), file=out)
    failed = [(h, s) for h, s in zip(handles, states) if not is_success(s)]
    for handle, state in failed:
        if not (stopped is not None and state.startswith("CANCELLED")):
            print(f"error: {handle.name} (job {handle.job_id}) ended {state}: "
                  f"{handle.error or 'see its log'}; "
                  f"full traceback: {handle.log_path(handle.failed_rank or 0)}", file=err)
    if not failed:
        print(f"every run completed; compare them with taehv_slurm.runs_frame([...], final=True) or "
              f"{command('status')} {' '.join(h.job_id for h in handles)}", file=out)
        return EXIT_DONE
    return stopped_exit_code(stopped) if stopped is not None else EXIT_FAILED
