"""Left alone for a night (real Slurm testbed, 3 nodes; faults inflicted from outside the job):

- `hung`: one rank of a 2-node training gets SIGSTOP mid-run. Every other rank then waits in a collective
  (mostly the gradient all-reduce); the watchdogs find it within max(30 s, 5 × the slowest step), write the
  bundle, and the job restarts without that node from its last checkpoint and completes.
- the clean runs of this suite name no slow rank and find no hang (checked on a run beside `hung`); the
  slowed ones, each slow in its own way, are in tests/test_stragglers.py;
- `hang_detection: false` and `slow_rank_windows: 0` switch the watchers off entirely (bench's A/B).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.faults import rank_record, wait_for
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.goodput import summary as goodput_summary
from taehv_slurm.handle import JobHandle
from taehv_slurm.training import submit_training
from tests.helpers import QUICK, cli, events, make_cluster, metrics, tiny_train, wait_done

pytestmark = pytest.mark.usefixtures("slurm_cluster")
STEADY = {"intervals.log_every": 2, "intervals.ckpt_every": 10, "intervals.val_every": 10_000}
HANG_FLOOR_S, HEARTBEAT_S = 30.0, 3.0


@dataclass
class Jobs:
    hung: JobHandle
    clean: JobHandle


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> Iterator[Jobs]:
    job_dir = tmp_path_factory.mktemp("hangs")
    # a hang floor of 30 s (default 60 s) keeps the test short; the detection is the same
    two_nodes = make_cluster(job_dir, nodes=2, gpus_per_node=1, time_min=20, hang_floor_s=HANG_FLOOR_S,
                             heartbeat_s=HEARTBEAT_S)
    one_node = make_cluster(job_dir, nodes=1, gpus_per_node=2, time_min=20)
    found = Jobs(hung=submit_training(two_nodes, tiny_train(steps=60, **STEADY), "hung")[0],
                 clean=submit_training(one_node, tiny_train(steps=60, **STEADY), "clean")[0])
    try:
        yield found
    finally:
        for handle in (found.hung, found.clean):
            handle.cancel()


def test_a_stopped_rank_is_found_named_and_left_behind(jobs: Jobs) -> None:
    handle = jobs.hung
    # Past the checkpoint of step 20 and, as its record lags a heartbeat (≤ 6 steps), short of the save at
    # 30: the others then wait in a step (a save's own timeout is uncalibrated this early in a run).
    wait_for(lambda: (rank_record(handle, 1).get("step") or 0) >= 21, 300, "training past a checkpoint")
    victim = rank_record(handle, 1)
    stopped_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGSTOP)  # a stuck GPU, a dead NFS mount: the process makes no progress
    (hang,) = wait_for(lambda: events(handle, "hang"), 300, "the hang to be found")
    found_after = time.monotonic() - stopped_at
    rows = [r for r in metrics(handle.run_dir) if "loss" in r]
    slowest = max((b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(rows[1:], rows[2:]))
    # detected within its timeout, plus one heartbeat to notice and a few seconds of margin
    assert found_after <= max(HANG_FLOOR_S, 5 * slowest) + HEARTBEAT_S + 10, (found_after, slowest)
    assert (hang["ranks"], hang["hosts"]) == ([1], [victim["host"]])
    # the others' section timed out after max(floor, 5 × the slowest step it saw): the floor, here
    assert 5 * slowest < HANG_FLOOR_S
    assert re.fullmatch(rf"hang: rank 1 on {victim['host']} stopped \(no sign of life for \d+ s: frozen, "
                        r"or its node is gone\); the others waited \d+ s in step "
                        rf"\(timeout {HANG_FLOOR_S:.0f} s\)", hang["detail"]), hang["detail"]
    bundle = Path(hang["bundle"])
    assert (bundle / "verdict.txt").read_text().strip() == hang["detail"]
    stacks = (bundle / "stacks-rank-0.txt").read_text()
    # rank 0 waits in a collective of torch.distributed: the gradient all-reduce, or those of the checkpoint
    # when the victim stopped between the two (CI once caught it there)
    assert "Thread" in stacks and re.search(r"distributed_c10d\.py\", line \d+ in \w+", stacks), stacks
    (requeue,) = wait_for(lambda: events(handle, "requeue"), 120, "the requeue after the verdict")
    assert requeue["reason"] == "hang" and requeue["excluded"] == [victim["host"]]
    assert wait_done(handle.job_id, 600) == "COMPLETED", handle.tail(60)
    start = events(handle, "start")[-1]
    assert victim["host"] not in {rank_record(handle, r)["host"] for r in (0, 1)}  # the next attempt's ranks
    assert start["step"] == requeue["step"] and start["step"] >= 20  # resumed from its last checkpoint
    kept = [r["step"] for r in metrics(handle.run_dir) if "loss" in r]
    assert kept == [1, *range(2, 61, 2)]  # every logged step once: nothing lost beyond the checkpoint
    lost_work_is_counted(handle, lost=hang["step"] - requeue["step"], kept_at=requeue["step"])


def lost_work_is_counted(handle: JobHandle, lost: int, kept_at: int) -> None:
    """Goodput: the first attempt trained `lost` steps past the checkpoint the next one resumed from; in
    JobHandle.goodput(), `taehv status --goodput` and the run's closing summary line."""
    assert lost > 0
    frame = handle.goodput()
    assert (list(frame["kept_until"]), list(frame["lost_steps"])) == ([kept_at, 60], [lost, 0])
    assert frame["lost_s"].iloc[0] > 0 and frame.attrs["lost_s"] == pytest.approx(frame["lost_s"].iloc[0])
    shown = cli("jobs.status", handle.job_id, "--goodput", "--format", "json", "--job-dir",
                str(handle.job_dir))
    assert shown.returncode == 0, shown.stderr
    assert [(r["attempt"], r["lost_steps"]) for r in json.loads(shown.stdout)] == [(0, lost), (1, 0)]
    line = goodput_summary(frame)
    assert re.fullmatch(rf"goodput: ETTR \d+ % of [\d.]+ node-h; first step after \d+ s \(start-up \d+ s\); "
                        rf"1 interruption\(s\) lost {lost} step\(s\) \(\d+ s\); saves [\d.]+ s", line), line


def test_a_clean_run_names_no_slow_rank_and_finds_no_hang(jobs: Jobs) -> None:
    handle = jobs.clean
    assert wait_done(handle.job_id, 600) == "COMPLETED", handle.tail(60)
    assert not events(handle, "slow_rank") and not events(handle, "hang")
    assert not [r for r in metrics(handle.run_dir) if r.get("slow_ranks")]


def test_the_watchers_switch_off_for_an_ab_of_their_cost(tmp_path: Path) -> None:
    # bench/e2e_throughput.py --watchers-ab measures the watchers' cost against these two switches: off
    # must mean no watchdog thread marking the rank's sections and no step timed, not only no verdict.
    quick = [f"{k}={v}" for k, v in QUICK.items()]
    for name, off in (("watched", []), ("unwatched", ["hang_detection=false", "slow_rank_windows=0"])):
        sets = [f"job_dir={tmp_path}", "steps=4", "intervals.log_every=1", *quick, *off]
        out = cli("jobs.submit", "--local", "--train", "configs/train/tiny.yaml", "--name", name,
                  *[a for s in sets for a in ("--set", s)])
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for name, watched in (("watched", True), ("unwatched", False)):
        record = json.loads(RunFolder(tmp_path / name).rank_record(0).read_text())
        assert record["exit_code"] == 0  # the record that names killed ranks is kept either way
        # watched: the main thread marked each step (the last one it entered); unwatched: it marked nothing
        assert ((record["step"] or 0) >= 3) is watched and (record["section"] != "startup") is watched, record
        rows = [r for r in metrics(tmp_path / name) if "loss" in r]
        assert len(rows) == 4 and all(("compute_s" in r) is watched for r in rows), rows
