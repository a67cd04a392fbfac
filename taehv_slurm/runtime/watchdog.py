"""Each rank's watchdog thread: keeps the rank's record fresh, and finds a job that stopped progressing.

Every `interval_s` it writes this rank's record (taehv_slurm.runtime.ranks: step, section, since) and
asks whether its main thread has stayed in one section longer than that section's timeout. Timeouts are
calibrated from what this run has seen: max(`floor_s`, `factor` × the slowest time seen in the section),
ignoring each section's first `warmup` occurrences (compilation, cold caches), and `uncalibrated_s`
(generous) until `calibrate_after` more have been seen. A collective stays under the process group's own
timeout (long, for rendezvous and saves); this watchdog is what makes a stuck training step short. A
peer whose record is no longer refreshed is frozen, which no calibration excuses: past `floor_s` in any
section, a wait on it is a hang (a first save's gather on a stopped rank is named as fast as a step's).

When a section times out, the rank reads every rank's record and names the culprits (`verdict`):
 - a record not refreshed for `stale_after_s`: that process is frozen (SIGSTOP, a hung driver, a dead
   NFS mount under a page fault) or its node is gone;
 - else the ranks that are behind: the lowest step, or at that step a section other than the one the
   others wait in (a rank stuck reading data while the others wait in the gradient all-reduce).
The lowest healthy rank acts, once per attempt (a claim file): it asks every rank for its Python stacks,
writes the bundle `hang-<job>-<restart>[-<launch>]/` in the run folder (verdict.txt, verdict.json,
stacks-rank-N.txt, NCCL's flight recorder on GPUs), and hands the verdict to `on_hang` (RequeueableTask
records it and has the job start its ranks again without the culprits' nodes: inside its allocation, or
requeued). Ranks blocked in a collective cannot be interrupted from Python; the end of their job step
(SIGKILL) or the requeue's signals and their grace end them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taehv_slurm.common.runfolder import write_text_atomic
from taehv_slurm.runtime.ranks import RankFile, describe_ranks, read_ranks

DUMP_REQUEST = "dump-request"


@dataclass(frozen=True)
class WatchdogSettings:
    """How a hang is told from a slow step (all in seconds); the cluster config's `hang_*` keys."""

    interval_s: float = 5.0  # record refresh and check period
    floor_s: float = 60.0  # no section times out faster than this
    factor: float = 5.0  # × the slowest time seen in the section
    uncalibrated_s: float = 1800.0  # until calibrated: compilation, first saves, slow rendezvous
    warmup: int = 2  # first occurrences of a section ignored for calibration
    calibrate_after: int = 3  # occurrences needed (after the warm-up) to calibrate
    enabled: bool = True  # False: no thread; the record is written at start and exit only

    @property
    def stale_after_s(self) -> float:
        return 3 * self.interval_s + 5.0


class SectionClock:
    """Per section: how often it has been seen and the slowest time (after the warm-up); its timeout."""

    def __init__(self, settings: WatchdogSettings) -> None:
        self.settings = settings
        self.seen: dict[str, int] = {}
        self.slowest: dict[str, float] = {}

    def finished(self, section: str, seconds: float) -> None:
        count = self.seen.get(section, 0) + 1
        self.seen[section] = count
        if count > self.settings.warmup:
            self.slowest[section] = max(self.slowest.get(section, 0.0), seconds)

    def timeout(self, section: str) -> float:
        s = self.settings
        if self.seen.get(section, 0) < s.warmup + s.calibrate_after:
            return s.uncalibrated_s
        return max(s.floor_s, s.factor * self.slowest.get(section, 0.0))


@dataclass
class Verdict:
    culprits: list[dict[str, Any]]  # the culprits' rank records
    why: dict[int, str]  # rank → why it is blamed
    section: str  # the section that timed out on the detecting rank
    waited_s: float
    timeout_s: float

    @property
    def hosts(self) -> list[str]:
        return sorted({r["host"] for r in self.culprits})

    def line(self) -> str:
        """'hang: rank 1 on tb2 stopped (no sign of life for 41 s); the others waited 63 s in step
        (timeout 60 s)'."""
        reasons = "; ".join(f"{describe_ranks([r])} {self.why[r['rank']]}" for r in self.culprits)
        return (f"hang: {reasons}; the others waited {self.waited_s:.0f} s in {self.section} "
                f"(timeout {self.timeout_s:.0f} s)")


def verdict(records: list[dict[str, Any]], now: float, stale_after_s: float, section: str, waited_s: float,
            timeout_s: float) -> Verdict:
    """Who stopped the job, from every rank's record (see the module docstring)."""
    why: dict[int, str] = {}
    for r in records:
        age = now - float(r["time"])
        if age > stale_after_s:
            why[r["rank"]] = f"stopped (no sign of life for {age:.0f} s: frozen, or its node is gone)"
    if not why and records:
        lowest = min(int(r["step"] or 0) for r in records)
        behind = [r for r in records if int(r["step"] or 0) == lowest]
        sections = [r["section"] for r in records if int(r["step"] or 0) == lowest]
        waiting = max(set(sections), key=sections.count)  # what most ranks at that step are doing
        stuck = ([r for r in behind if r["section"] != waiting]
                 or (behind if len(behind) < len(records) else []))
        for r in stuck:
            stuck_s = now - float(r["since"])
            why[r["rank"]] = f"stuck in {r['section']} at step {r['step']} for {stuck_s:.0f} s"
    culprits = [r for r in records if r["rank"] in why]
    return Verdict(culprits, why, section, waited_s, timeout_s)


class Watchdog:
    """The thread; `enter(section, step)` from the main thread marks progress (in memory only)."""

    def __init__(self, run_dir: Path, rank_file: RankFile, settings: WatchdogSettings,
                 on_hang: Callable[[Verdict, Path], None]) -> None:
        self.run_dir, self.rank_file, self.settings, self.on_hang = run_dir, rank_file, settings, on_hang
        self.clock = SectionClock(settings)
        me = rank_file.record  # one bundle per job step: its attempt, and its launch inside the allocation
        self.bundle = run_dir / f"hang-{me.job_id}-{me.restart}{f'-{me.launch}' if me.launch else ''}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="taehv-watchdog", daemon=True)
        self._acted = False

    def start(self) -> None:
        self.rank_file.started()
        if self.settings.enabled:
            self._thread.start()

    def enter(self, section: str, step: int | None = None) -> None:
        record = self.rank_file.record
        self.clock.finished(record.section, time.time() - record.since)
        self.rank_file.enter(section, step)

    def stop(self, exit_code: int | None = None) -> None:
        self._stop.set()
        if exit_code is not None:
            self.rank_file.exited(exit_code)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            self.rank_file.write()
            with contextlib.suppress(OSError):
                self._dump_if_asked()
            record = self.rank_file.record
            if self._acted:  # (the thread runs only where hang detection is enabled)
                continue
            waited = time.time() - record.since
            timeout = self.clock.timeout(record.section)
            if waited > self.settings.floor_s and timeout > self.settings.floor_s and self._peer_frozen():
                timeout = self.settings.floor_s
            if waited > timeout:
                self._acted = True
                self._hang(record.section, waited, timeout)

    def _peer_frozen(self) -> bool:
        """A peer whose record is no longer refreshed is frozen (stopped, a hung driver, a lost node): this
        rank's wait is a hang however new its section (a first save's gather waits on it as a step does).
        Rank 0 reads every record and the others rank 0's, so a check costs 2 × world-size reads, not
        world size squared; a frozen rank 0 is seen by all."""
        me = self.rank_file.record
        records = read_ranks(self.run_dir, me.job_id, me.restart, me.launch, None if me.rank == 0 else 0)
        oldest = min((float(r["time"]) for r in records if r["rank"] != me.rank), default=time.time())
        return time.time() - oldest > self.settings.stale_after_s

    def _dump_if_asked(self) -> None:
        rank = self.rank_file.record.rank
        target = self.bundle / f"stacks-rank-{rank}.txt"
        if (self.bundle / DUMP_REQUEST).exists() and not target.exists():
            with open(target, "w") as f:
                f.write(f"rank {rank} on {self.rank_file.record.host}, pid {os.getpid()}, in "
                        f"{self.rank_file.record.section} at step {self.rank_file.record.step}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            dump_nccl_flight_recorder(self.bundle / f"nccl-flight-recorder-rank-{rank}.pkl")

    def _hang(self, section: str, waited: float, timeout: float) -> None:
        """This rank's section timed out: name the culprits; the lowest healthy rank writes the bundle and
        acts."""
        me = self.rank_file.record
        records = read_ranks(self.run_dir, me.job_id, me.restart, me.launch)
        found = verdict(records, time.time(), self.settings.stale_after_s, section, waited, timeout)
        healthy = [r["rank"] for r in records if r["rank"] not in found.why]
        if not healthy or min(healthy) != me.rank:
            return  # the lowest healthy rank acts
        self.bundle.mkdir(exist_ok=True)
        try:  # once per attempt, whichever rank gets here first
            os.close(os.open(self.bundle / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        (self.bundle / DUMP_REQUEST).touch()
        self._dump_if_asked()
        deadline = time.time() + 2 * self.settings.interval_s + 2
        while time.time() < deadline and len(list(self.bundle.glob("stacks-rank-*.txt"))) < len(healthy):
            time.sleep(0.2)
        write_text_atomic(self.bundle / "verdict.txt", found.line() + "\n", 0o600)
        write_text_atomic(self.bundle / "verdict.json", json.dumps({
            "line": found.line(), "culprits": found.culprits, "why": found.why, "hosts": found.hosts,
            "section": section, "waited_s": round(waited, 1), "timeout_s": round(timeout, 1),
            "records": records}, indent=1, default=str) + "\n", 0o600)
        self.on_hang(found, self.bundle)


def dump_nccl_flight_recorder(path: Path) -> None:
    """NCCL's flight recorder of this rank (the last collectives, on GPUs), where torch has one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return
        dump = torch._C._distributed_c10d._dump_nccl_trace  # torch's on-demand dump (no public API yet)
        path.write_bytes(dump())
    except Exception:  # an older torch, no NCCL group: the stacks are the bundle
        return
