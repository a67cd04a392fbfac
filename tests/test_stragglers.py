"""The rank the others wait for is named, with its cause (real Slurm testbed, CPU, gloo; each fault inflicted
from outside the job, on rank 1 of a job of 2 ranks, as a slow node would):

- `host`: the rank's process stopped 0.6 s of every 0.7 s (SIGSTOP/SIGCONT: a throttled or starved host;
  its running spells shorter than a window's work, so that every window holds a stop) →
  named with cause host after 3 late log windows in a row: within 4 windows of the fault's start (the one
  in progress when it begins is the first, late or not; docs/failures.md says the same); the
  run goes on (report only); `taehv status` notes the share of the step time it cost, and
  `JobHandle.metrics()` has each window's figures;
- `data`: the rank's loader worker stopped 0.9 s of every second → cause data;
- `compute`: the rank given 0.2 s more compute per step (bench/slower_device, on the job's PYTHONPATH from
  outside the product) → cause compute (the CPU is the device here);
- a process stopped while it waits (as a rank for its loader) is found held off the CPU (`HeldOff`), so
  its stall is not taken for its loader's;
- `latest_rank`'s verdicts on given figures (windows measured on a GPU among them), the slow link among
  them, and a rank however stalled that the others never wait for (a throttle that costs nothing) named
  never (the testbed's nodes share this machine's loopback with every other job on it: no link can be
  slowed from outside for one job alone).

The three jobs run side by side from one module fixture. A clean run names nobody:
tests/test_hangs.py::test_a_clean_run_names_no_slow_rank_and_finds_no_hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bench.faults import children, rank_record, slowed_down, slower_device_env, wait_for
from taehv_slurm.handle import JobHandle
from taehv_slurm.reports import slow_rank_note
from taehv_slurm.trainer.stragglers import WARMUP_STEPS, SlowRanks, latest_rank
from taehv_slurm.training import submit_training
from tests.helpers import cli, events, make_cluster, metrics, quick_train

STEADY = {"steps": 100_000, "intervals.log_every": 2, "intervals.ckpt_every": 100_000,
          "intervals.val_every": 100_000}
WINDOWS = 3  # slow_rank_windows as shipped
LOADER = {"intervals.log_every": 4, "data.num_workers": 1, "data.prefetch_factor": 1}


@dataclass
class Jobs:
    host: JobHandle
    data: JobHandle
    compute: JobHandle


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> Iterator[Jobs]:
    job_dir = tmp_path_factory.mktemp("stragglers")
    plain = make_cluster(job_dir, nodes=1, gpus_per_node=2, time_min=20)
    # one loader worker per rank, one batch ahead: a stopped worker is soon waited for. It runs a twentieth of
    # the time (slow_loader) and a window is 4 steps (LOADER): with a 2-step window and a worker running a
    # tenth of each second, on a loaded 2-core machine a window caught its running tenth or not, by chance.
    host = submit_training(plain, quick_train(**STEADY), "host")[0]
    data = submit_training(plain, quick_train(**{**STEADY, **LOADER}), "data")[0]
    with pytest.MonkeyPatch.context() as environ:  # the job takes the submitting environment with it
        for key, value in slower_device_env(1, 0.2).items():
            environ.setenv(key, value)
        compute = submit_training(plain, quick_train(**STEADY), "compute")[0]
    found = Jobs(host=host, data=data, compute=compute)
    try:
        yield found
    finally:
        for handle in (found.host, found.data, found.compute):
            handle.cancel()


def timed_rows(handle: JobHandle) -> list[dict[str, Any]]:
    return [r for r in metrics(handle.run_dir) if "late_s" in r]


def named_after(handle: JobHandle, inflict: Callable[[int], contextlib.AbstractContextManager],
                what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Inflict the fault on rank 1 once it trains, until it is named: (the slow_rank event, log windows from
    the fault's start to its naming, the one in progress at the start counted)."""
    # past the warm-up, whose steps are not judged
    wait_for(lambda: (rank_record(handle, 1).get("step") or 0) >= WARMUP_STEPS + 2, 300,
             f"{handle.name} to train")
    with inflict(rank_record(handle, 1)["pid"]):
        began = time.time()
        (slow,) = wait_for(lambda: events(handle, "slow_rank"), 300, f"the {what} to be named")
    named_at = min(r["step"] for r in timed_rows(handle) if r.get("slow_ranks"))
    # the windows that ended after the fault began (on a loaded machine reading the last step first took
    # 5 s: 9 windows were counted from it, 4 from the fault)
    return slow, [r for r in timed_rows(handle) if r["time"] > began and r["step"] <= named_at]


def judged(windows: list[dict[str, Any]]) -> list[tuple]:
    """Each window's verdict, for an assertion's message: (step, late rank, late, its lateness, the
    others' time to arrive)."""
    return [(r["step"], r["late_rank"], r["late"], round(r["late_s"], 3), round(r["arrive_s"], 3))
            for r in windows]


@contextlib.contextmanager
def slow_loader(pid: int) -> Iterator[None]:
    workers = wait_for(lambda: children(pid), 60, "the loader worker")
    with slowed_down(workers, 1.9, 0.1):
        yield


def test_a_rank_with_more_compute_is_named_with_cause_compute(jobs: Jobs) -> None:
    handle = jobs.compute
    (slow,) = wait_for(lambda: events(handle, "slow_rank"), 300, "the loaded rank to be named")
    host = rank_record(handle, 1)["host"]
    assert (slow["rank"], slow["host"], slow["cause"]) == (1, host, "compute"), slow
    assert slow["detail"].startswith(f"rank 1 on {host}: the others wait "), slow
    assert "cause compute: its compute takes" in slow["detail"]
    handle.cancel()


def test_a_throttled_host_is_named_with_cause_host_within_three_windows(jobs: Jobs) -> None:
    handle = jobs.host
    # Each running spell (0.04 s) is shorter than the rank's own work of one step (about 0.05 s alone on a
    # core, 2 steps a window): every window holds stops. Spells as long as a window's work (0.1 s) let a
    # window fall between two stops at times, on time, and under CI's load the streak of 3 took 6 windows.
    slow, windows = named_after(handle, lambda pid: slowed_down(pid, 0.6, 0.04), "throttled host")
    host = rank_record(handle, 1)["host"]
    assert (slow["rank"], slow["host"], slow["cause"]) == (1, host, "host"), slow
    assert len(windows) <= WINDOWS + 1, judged(windows)
    assert slow["detail"].startswith(f"rank 1 on {host}: the others wait ")
    assert slow["lost_s"] > 0 and "cause host: its process was off the CPU" in slow["detail"]
    frame = handle.metrics()  # every window's figures, as pandas columns
    named = frame[frame["slow_ranks"].notna()].iloc[0]
    assert (named["late_rank"], named["late_host"], named["late_cause"]) == (1, host, "host")
    assert named["late"] and named["late_s"] > 0 and named["arrive_s"] > 0 and named["wait_s"] > 0
    status = json.loads(cli("jobs.status", handle.job_id, "--job-dir", str(handle.job_dir), "--format",
                            "json").stdout)
    assert f"rank 1 on {host} (cause host) cost " in status[0]["note"], status
    named_step = max(r["step"] for r in timed_rows(handle))
    wait_for(lambda: (handle.last_step() or 0) >= named_step + 10, 300, "training to go on")  # report only
    assert handle.state == "RUNNING"
    assert not events(handle, "hang") and not events(handle, "requeue")
    handle.cancel()


def test_a_slow_loader_is_named_with_cause_data(jobs: Jobs) -> None:
    handle = jobs.data
    slow, windows = named_after(handle, slow_loader, "slow loader")
    assert (slow["rank"], slow["cause"]) == (1, "data"), slow
    assert "cause data: it waits " in slow["detail"], slow
    assert len(windows) <= WINDOWS + 1, judged(windows)
    handle.cancel()


# A process that waits (as a rank for its loader) for a line on stdin, three times; prints how long it
# waited each time and how long HeldOff found it held off the CPU meanwhile.
WAITER = """
import sys, time
from taehv_slurm.trainer.stragglers import HeldOff
held_off = HeldOff()
print("ready", flush=True)
for _ in range(3):
    began = time.perf_counter()
    with held_off.watch() as held:
        sys.stdin.readline()
    print(round(time.perf_counter() - began, 3), round(held(), 3), flush=True)
"""


def test_a_process_stopped_while_it_waits_is_held_off_not_waiting() -> None:
    """What lets a rank stopped while it waits for its loader be named `host`, not `data`: SIGSTOP from
    outside, as a throttled node would; the waiter's loader (here: this test) keeps running."""
    waiter = subprocess.Popen([sys.executable, "-c", WAITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert waiter.stdout.readline().strip() == "ready"

        def answer(stop_s: float, then_s: float, during: bool) -> tuple[float, float]:
            """Stop the waiter for stop_s, then answer it (`during`: while still stopped) after then_s."""
            time.sleep(0.3)
            os.kill(waiter.pid, signal.SIGSTOP)
            time.sleep(stop_s)
            if during:
                waiter.stdin.write("go\n")
                waiter.stdin.flush()
            os.kill(waiter.pid, signal.SIGCONT)
            time.sleep(then_s)
            if not during:
                waiter.stdin.write("go\n")
                waiter.stdin.flush()
            waited, held = map(float, waiter.stdout.readline().split())
            return waited, held

        waited, held = answer(0.0, 0.5, during=False)  # nothing stopped: a plain wait
        assert waited >= 0.5 and held < 0.1, (waited, held)
        waited, held = answer(1.0, 0.5, during=False)  # stopped, then waiting again
        assert waited >= 1.8 and 0.9 <= held <= 1.2, (waited, held)
        waited, held = answer(1.0, 0.0, during=True)  # its answer came while it was stopped
        assert waited >= 1.3 and 0.9 <= held <= 1.2, (waited, held)
    finally:
        waiter.kill()
        waiter.wait()


# ----------------------------------------------------------------------- the verdicts on given figures
# Per rank: step, wait, compute, data, stall, host, backlog (seconds per step), as LogWindow.timings() gathers
# them.
CLEAN = [0.5, 0.02, 0.45, 0.01, 0.02, 0.1, 0.3]


def late(rank: int, *figures: str) -> list[list[float]]:
    """Four ranks of a 0.5 s step; `rank` 0.2 s late (the others wait for it) with 0.2 s more of each of
    `figures` (a stall is host time too; more compute on a GPU leaves its device that much further behind
    its host, more backlog)."""
    rows = [[0.5, 0.22, 0.25, 0.01, 0.02, 0.1, 0.15] for _ in range(4)]
    rows[rank][1] = 0.02
    for figure in figures:
        rows[rank][("compute", "data", "stall", "host").index(figure) + 2] += 0.2
        if figure == "compute":
            rows[rank][6] += 0.2
    return rows


def measured(step: float, others: list[float], slow: list[float]) -> list[list[float]]:
    """Two ranks as one window of bench/slow_rank_faults.py found them on 2 nodes sharing an H200 through
    Slurm (2026-11-29, metrics.jsonl's late_figures_s and late_excess_s), the late one 3rd of 4 here: the
    step, the others' figures, then the late rank's."""
    return [[step, *others], [step, *others], [step, *slow], [step, *others]]


@pytest.mark.parametrize("figures, device, cause", [
    (late(2, "stall", "host"), "GPU", "host"),  # stopped or starved: off the CPU during its own work
    # stopped 0.25 s of every 0.5 s on a GPU: its GPU idle between the events that time the compute (+0.29 s
    # of "compute"), its stall no more than the others', whose hosts block on their GPUs waiting for it
    (measured(0.64, [0.304, 0.189, 0.043, 0.331, 0.414, 0.031], [0.017, 0.477, 0.144, 0.309, 0.347, 0.018]),
     "GPU", "host"),
    (late(2, "host"), "GPU", "host"),  # slow on the CPU without a stall: launches, Python
    # loader workers stopped 0.45 s of every 0.5 s: +1.36 s of data wait, +1.31 s of "compute" (idle GPU)
    (measured(1.6, [1.328, 0.174, 0.046, 1.347, 1.424, 0.031], [0.018, 1.485, 1.402, 0.057, 0.098, 0.004]),
     "GPU", "data"),
    (late(2, "data"), "GPU", "data"),
    # +0.25 s of device work: 0.23 s further behind its host at the all-reduce than the others' GPUs
    (measured(0.58, [0.249, 0.215, 0.031, 0.308, 0.403, 0.043], [0.018, 0.446, 0.047, 0.275, 0.386, 0.271]),
     "GPU", "GPU"),
    (late(2, "compute"), "GPU", "GPU"),
    (late(2, "compute"), "compute", "compute"),  # on a CPU
    # on a shared CPU more compute also waits longer for a core: still its compute's doing
    ([[0.5, 0.32, 0.1, 0.01, 0.07, 0.17, 0.0]] * 2 + [[0.5, 0.02, 0.2, 0.01, 0.27, 0.47, 0.0],
                                                     [0.5, 0.32, 0.1, 0.01, 0.07, 0.17, 0.0]], "compute",
     "compute"),
    (late(2), "GPU", "host"),  # nothing sets it apart but its lateness: launches, Python, the step's rest
])
def test_the_cause_is_what_sets_the_latest_rank_apart(figures: list[list[float]], device: str,
                                                         cause: str) -> None:
    verdict = latest_rank(figures, ["n0", "n1", "n2", "n3"], margin=0.3, compute_name=device)
    assert verdict is not None and (verdict.rank, verdict.cause, verdict.late) == (2, cause, True), verdict
    assert verdict.lost_s == pytest.approx(figures[0][1] - figures[2][1])  # the others' wait less its own
    assert verdict.detail.startswith(f"rank 2 on n2: the others wait {verdict.lost_s:.3f} s per step for it")


def test_a_throttle_that_costs_the_others_nothing_is_never_named() -> None:
    """A host stopped half the time while its GPU stays busy (measured through Slurm on an H200: CUDA graphs
    kept a 2 s step queued, 63.7 → 63.2 clips/s) stalls its own process, but the others do not wait for it:
    late only by what the others lose, it is never named, however long its stall lasts."""
    stalled = [[0.5, 0.05, 0.4, 0.01, 0.02, 0.1, 0.3] for _ in range(4)]
    stalled[2][1] = 0.045  # it arrives last, by a hair: the others lose 5 ms per step
    stalled[2][4] = stalled[2][5] = 0.25  # off the CPU a quarter second per step, all of it its own work
    verdict = latest_rank(stalled, ["n0", "n1", "n2", "n3"], margin=0.1, compute_name="GPU")
    assert verdict is not None and (verdict.rank, verdict.late) == (2, False), verdict
    slow = SlowRanks(["n0", "n1", "n2", "n3"], margin=0.1, windows=3)
    for _ in range(6):
        fields, new, _ = slow.observe(stalled)
        assert (new, fields["late"], "slow_ranks" in fields) == ([], False, False), fields
    stalled[2][1] = 0.0  # the same stall once the others wait for it (0.05 s per step, 11 % of theirs)
    assert [slow.observe(stalled)[1] for _ in range(2)] == [[], []]
    assert [n.rank for n in slow.observe(stalled)[1]] == [2]


def test_a_slow_collective_with_every_rank_on_time_is_the_link() -> None:
    verdict = latest_rank([[0.5, 0.25, 0.2, 0.01, 0.01, 0.1, 0.1]] * 4, ["n0", "n1", "n2", "n3"], margin=0.3)
    assert verdict is not None and (verdict.rank, verdict.cause, verdict.late) == (None, "link", True)
    assert verdict.detail.startswith("every rank arrives together, but the step's collectives take 0.250 s")
    assert latest_rank([CLEAN] * 4, ["n0"] * 4, margin=0.3).late is False  # type: ignore[union-attr]


def test_the_link_is_named_when_its_collectives_grow_not_for_their_share_of_every_step() -> None:
    """A gradient all-reduce takes its share of every step (2 nodes over sockets, one H200: 10 % of a step,
    named `link` in every run before this rule): the link is slow when its collectives take longer than at
    their fastest in this run."""
    hosts = ["n0", "n1", "n2", "n3"]
    steady = SlowRanks(hosts, margin=0.1, windows=3)
    slow_link = [[0.5, 0.25, 0.2, 0.01, 0.01, 0.1, 0.1]] * 4  # every rank on time, collectives 0.25 s
    assert not any(steady.observe(slow_link)[1] for _ in range(5))  # so from the start: not a slow link
    grown = SlowRanks(hosts, margin=0.1, windows=3)
    assert not grown.observe([CLEAN] * 4)[1]  # collectives 0.02 s at first
    seen = [grown.observe(slow_link) for _ in range(3)]
    assert not seen[0][1] and not seen[1][1] and [n.rank for n in seen[2][1]] == [None]
    assert seen[2][1][0].lost_s == pytest.approx(0.23)
    detail = seen[2][1][0].detail
    assert "take 0.250 s per step (50 % of a step), 0.230 s more than at their fastest" in detail


def test_a_rank_is_named_after_its_windows_in_a_row_and_then_recovers() -> None:
    slow = SlowRanks(["n0", "n1", "n2", "n3"], margin=0.3, windows=3)
    seen = [slow.observe(f) for f in (late(1, "stall"), [CLEAN] * 4, late(1, "stall"), late(1, "stall"))]
    assert not any(new for _, new, _ in seen)  # never 3 in a row yet
    fields, new, _ = slow.observe(late(1, "stall"))
    assert [n.rank for n in new] == [1] and fields["slow_ranks"][0].startswith("rank 1 on n1: ")
    assert (fields["late_rank"], fields["late_cause"], fields["late"]) == (1, "host", True)
    assert slow.observe(late(1, "stall"))[1] == []  # named once
    fields, new, recovered = slow.observe([CLEAN] * 4)
    assert (new, recovered, "slow_ranks" in fields, fields["late"]) == ([], [1], False, False)


def test_the_warm_up_windows_are_not_judged() -> None:
    """Compilation, CUDA-graph capture and autotuning make a start's first steps uneven across ranks: late
    windows then start no streak, and a rank still late after the warm-up needs its own windows in a row."""
    slow = SlowRanks(["n0", "n1", "n2", "n3"], margin=0.3, windows=3)
    for _ in range(5):
        fields, new, _ = slow.observe(late(1, "compute"), judged=False)
        assert new == [] and "late_rank" not in fields and fields["wait_s"] > 0
    assert [slow.observe(late(1, "compute"))[1] for _ in range(2)] == [[], []]
    assert [n.rank for n in slow.observe(late(1, "compute"))[1]] == [1]


def test_status_notes_a_rank_named_slow_that_cost_the_run_its_share() -> None:
    def row(step: int, rank: int, late_s: float, is_late: bool, named: bool = False) -> dict[str, Any]:
        named_now = {"slow_ranks": [f"rank {rank} on n{rank}: …"]} if named else {}
        return {"step": step, "arrive_s": 0.45, "wait_s": 0.05, "late_rank": rank, "late_host": f"n{rank}",
                "late_cause": "host", "late_s": late_s, "late": is_late, **named_now}

    # late windows by chance count for nobody; step 1 (the start) never counts
    rows = [row(1, 1, 5.0, True), row(2, 1, 0.4, True), row(4, 1, 0.4, True), row(6, 0, 0.4, True)]
    rows += [row(n, n % 4, 0.01, False) for n in range(8, 48, 2)]
    assert slow_rank_note(rows) is None
    # one streak named at its third window, and late on after it: all 5 count (1 s of 14 s of steps)
    rows += [row(n, 1, 0.2, True, named=n >= 52) for n in range(48, 58, 2)]
    assert slow_rank_note(rows) == ("rank 1 on n1 (cause host) cost 7 % of the step time: the others waited "
                                    "for it in 5 log window(s)")
    assert slow_rank_note(rows, share=0.1) is None
    assert slow_rank_note([{"step": 2, "loss": 1.0}]) is None  # not timed (one rank, ZeRO, switched off)
