"""A lost node costs a minute, not a place in the queue (real Slurm testbed, 3 nodes; faults inflicted from
outside the job, as a cluster inflicts them):

- `spare`: a 2-node run with 1 spare node (2 ranks per node); every rank of its second node is SIGKILLed: the
  job starts its ranks again on the spare, inside the allocation it holds — same job id, no requeue, world
  size kept, at most a checkpoint interval of steps lost — within 60 s plus the start-up; it completes with
  every step logged once.
- `stopped`: the same run, one rank of the second node SIGSTOPped: the hang verdict (floor 30 s), then the
  same restart on the spare, within the hang threshold + 60 s plus the start-up.
- `shrink`: no spare, `min_nodes: 1`: the second node's ranks killed, the run goes on with one node at the
  same effective batch (twice the accumulation), and after its next requeue (`scontrol requeue`) it is back
  on two.
- a restart's `release_error`: where Slurm refuses to take the left-out nodes back (`scontrol update
  NodeList=`, a site's policy), the restart records scontrol's answer in one line and the job keeps them.
Without a spare and with `min_nodes` at `nodes` (the default), a lost node still requeues the job without it
(tests/test_hangs.py, tests/test_failures.py).
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.faults import rank_record, wait_for
from taehv_slurm.backends import SlurmBackend
from taehv_slurm.goodput import attempt_rows
from taehv_slurm.handle import JobHandle
from taehv_slurm.runtime import steps
from taehv_slurm.runtime.steps import Placement
from taehv_slurm.slurm import SCONTROL_ENV, expand_hosts, job_info
from taehv_slurm.training import submit_training
from tests.helpers import events, make_cluster, metrics, quick_train, wait_done

pytestmark = pytest.mark.usefixtures("slurm_cluster")
CKPT_EVERY, HANG_FLOOR_S, HEARTBEAT_S = 10, 30.0, 3.0
STEADY = {"intervals.log_every": 2, "intervals.ckpt_every": CKPT_EVERY, "intervals.val_every": 10_000}


@pytest.fixture(scope="module")
def job_dir(slurm_cluster, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("restarts")


# Each test submits its own run, ended with the test: runs submitted ahead, to be training when their test
# came, took the suite's CPU for minutes (it is CPU-bound on 2 cores) only to wait.
@pytest.fixture
def submit(job_dir: Path) -> Iterator[Callable[..., JobHandle]]:
    """Submits a run of 2 nodes × 2 ranks: `steps` steps, the cluster `overrides` (train ones dotted)."""
    submitted: list[JobHandle] = []

    def submit(name: str, steps: int, **overrides) -> JobHandle:
        train = {k: overrides.pop(k) for k in list(overrides) if "." in k}
        cluster = make_cluster(job_dir, nodes=2, gpus_per_node=2, time_min=20, hang_floor_s=HANG_FLOOR_S,
                               heartbeat_s=HEARTBEAT_S, **overrides)
        submitted.append(submit_training(cluster, quick_train(steps=steps, **STEADY, **train), name)[0])
        return submitted[-1]
    yield submit
    for handle in submitted:
        handle.cancel()


def ranks_of_the_second_node(handle: JobHandle) -> list[dict]:
    """The records of the ranks on the node of the highest rank (not the batch script's node)."""
    wait_for(lambda: (rank_record(handle, 3).get("step") or 0) >= 25, 300, "training past a checkpoint")
    records = [rank_record(handle, r) for r in range(4)]
    return [r for r in records if r["host"] == records[3]["host"]]


def restarted(handle: JobHandle) -> tuple[dict, dict]:
    """The restart event and the first step of the segment it started."""
    (restart,) = wait_for(lambda: events(handle, "restart"), 300, "the restart inside the allocation")
    first = wait_for(lambda: [e for e in events(handle, "first_step")
                              if e["segment"] == restart["segment"] + 1], 300, "the first step after it")[0]
    return restart, first


def logged_once_each(handle: JobHandle, until: int) -> bool:
    """Every logged step up to `until` once: nothing lost beyond the checkpoint, nothing trained twice."""
    kept = [r["step"] for r in metrics(handle.run_dir) if "loss" in r]
    return [s for s in kept if s <= until] == [1, *range(2, until + 1, 2)]


def test_a_node_killed_is_replaced_by_the_spare_inside_the_allocation(submit) -> None:
    handle = submit("spare", 160, spare_nodes=1)
    victims = ranks_of_the_second_node(handle)
    host = victims[0]["host"]
    killed_at = time.time()
    for record in victims:  # every rank of one node, as a node taken away leaves them
        os.kill(record["pid"], signal.SIGKILL)
    restart, first = restarted(handle)
    assert restart["cause"] == "killed" and restart["left_out"] == [host]
    assert host not in restart["nodes"] and len(restart["nodes"]) == 2 and host in restart["nodes_before"]
    assert restart["world_before"] == restart["world_after"] == 4  # the spare keeps the world size
    # the node left out went back to Slurm at once (the batch script's node and the spare stay)
    assert (restart["released"], restart["nodes_held"]) == ([host], 2), restart
    job = job_info(handle.job_id)
    assert host not in expand_hosts(job["NodeList"])
    # scontrol's scripts for a resized job's environment are not left in the job's (the user's) folder
    assert not list(Path(job["WorkDir"]).glob(f"slurm_job_{handle.job_id}_resize.*"))
    assert restart["failed_at_step"] - restart["step"] <= CKPT_EVERY  # at most a checkpoint interval lost
    start = next(e for e in events(handle, "start") if e["segment"] == restart["segment"] + 1)
    assert (start["job_id"], start["world_size"], start["step"]) == (handle.job_id, 4, restart["step"])
    # training again within a minute of the kill, plus the new step's own start-up (start to first step)
    assert first["time"] - killed_at <= 60 + first["seconds"], (first["time"] - killed_at, first["seconds"])
    assert not events(handle, "requeue")  # it never went back to the queue
    assert wait_done(handle.job_id, 600) == "COMPLETED", handle.tail(60)
    assert logged_once_each(handle, 160)
    assert host not in {rank_record(handle, r)["host"] for r in range(4)}  # the last step's ranks
    # goodput: one row per job step of the one allocation; the restart's seconds apart from the queue's;
    # the allocation's node-seconds as Slurm counted them: 3 nodes (the spare included) until the release,
    # 2 after it (sacct: a RESIZING record, then the job's own)
    accounting = handle.accounting()
    sizes = accounting[~accounting["JobID"].str.contains(".", regex=False)].to_dict("records")
    assert [(r["State"], int(r["NNodes"]), r["Attempt"]) for r in sizes] == [("RESIZING", 3, 0),
                                                                             ("COMPLETED", 2, 0)]
    goodput = handle.goodput()
    assert list(goodput["attempt"]) == [0, 0] and list(goodput["launch"]) == [0, 1]
    assert list(goodput["nodes"]) == [3, 2]
    assert 0 <= goodput["restart_s"].iloc[1] <= first["time"] - killed_at  # fault found → ranks started
    assert goodput["queue_s"].iloc[0] >= 0 and goodput["restart_s"].isna().iloc[0]
    held = sum(r["ElapsedSeconds"] * int(r["NNodes"]) for r in sizes)
    assert goodput.attrs["allocated_node_s"] == pytest.approx(held, rel=0.01)


def test_a_stopped_rank_is_named_and_its_node_replaced_by_the_spare(submit) -> None:
    handle = submit("stopped", 2000, spare_nodes=1)
    victim = ranks_of_the_second_node(handle)[-1]
    stopped_at = time.time()
    os.kill(victim["pid"], signal.SIGSTOP)  # a stuck GPU, a dead NFS mount: no progress, no exit
    restart, first = restarted(handle)
    (hang,) = events(handle, "hang")
    assert hang["ranks"] == [victim["rank"]] and hang["hosts"] == [victim["host"]]
    assert restart["cause"] == "hang" and restart["left_out"] == [victim["host"]]
    assert restart["world_after"] == 4 and not events(handle, "requeue")
    threshold = HANG_FLOOR_S + HEARTBEAT_S + 10  # the hang's floor, noticed within a heartbeat, and margin
    assert first["time"] - stopped_at <= threshold + 60 + first["seconds"], first["time"] - stopped_at
    until = restart["step"] + 20
    wait_for(lambda: (rank_record(handle, 0).get("step") or 0) > until, 300, "training after the restart")
    assert logged_once_each(handle, until)
    # The spare's node lost as well: no usable set is left (min_nodes 2), so the job requeues — at its full
    # size, though the restart gave a node back (Slurm's NumNodes shrank): excluding the node as well would
    # leave the partition too small for it, and it would wait in the queue for good.
    spare = [r for r in map(lambda rank: rank_record(handle, rank), range(4))
             if r["host"] not in (victim["host"], rank_record(handle, 0)["host"])]
    assert len(spare) == 2, spare
    for record in spare:
        os.kill(record["pid"], signal.SIGKILL)
    (requeue,) = wait_for(lambda: events(handle, "requeue"), 300, "the requeue")
    again = wait_for(lambda: [e for e in events(handle, "start") if e["restart_count"] == 1], 300,
                     "the start after the requeue")[0]
    assert again["world_size"] == 4 and requeue.get("excluded_now", []) == [], requeue


def test_without_a_spare_the_run_shrinks_then_grows_back_at_its_requeue(submit) -> None:
    handle = submit("shrink", 2000, min_nodes=1, **{"batch.per_gpu": 2})
    victims = ranks_of_the_second_node(handle)
    for record in victims:
        os.kill(record["pid"], signal.SIGKILL)
    restart, _ = restarted(handle)
    assert restart["cause"] == "killed" and len(restart["nodes"]) == 1
    assert (restart["world_before"], restart["world_after"]) == (4, 2)
    assert restart["released"] == [victims[0]["host"]] and restart["nodes_held"] == 1  # given back at once
    starts = events(handle, "start")
    shrunk = next(e for e in starts if e["segment"] == restart["segment"] + 1)
    assert shrunk["world_size"] == 2 and shrunk["effective_batch"] == starts[0]["effective_batch"]
    assert shrunk["grad_accum"] == 2 * starts[0]["grad_accum"]  # the same batch, over half the ranks
    wait_for(lambda: (rank_record(handle, 1).get("step") or 0) >= shrunk["step"] + 10, 300,
             "training on one node")
    subprocess.run(["scontrol", "requeue", handle.job_id], check=True)  # a preemption: back in the queue
    (requeue,) = wait_for(lambda: events(handle, "requeue"), 300, "the requeue")
    grown = wait_for(lambda: [e for e in events(handle, "start") if e["segment"] > shrunk["segment"]], 300,
                     "the start after the requeue")[0]
    assert requeue["reason"] == "preempted" and grown["world_size"] == 4  # its full size again
    assert grown["restart_count"] == 1


def test_nodes_slurm_refuses_to_take_back_are_a_release_error_and_stay_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a restart does with the nodes it left out (its event's `released`, `nodes_held` or
    `release_error`), on a 2-node allocation: scontrol refusing the shrink is one line, and the job holds
    both nodes still; the real scontrol gives the node back."""
    sbatch = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--time=5", f"--output={tmp_path / 'out'}",
                             "--wrap", "sleep 300"], capture_output=True, text=True, check=True)
    job = sbatch.stdout.strip().split(";")[0]
    try:
        info = wait_for(lambda: (i := job_info(job)) and i.get("JobState") == "RUNNING" and i, 60, "the job")
        held = expand_hosts(info["NodeList"])
        other = [n for n in held if n != info["BatchHost"]]
        refusing = tmp_path / "scontrol"  # the real scontrol, but `update` refused as a site's policy may
        refuse = 'echo "scontrol: error: Access/permission denied" >&2; exit 1'
        real = shutil.which("scontrol")
        refusing.write_text(f'#!/bin/sh\n[ "$1" = update ] && {{ {refuse}; }}\nexec {real} "$@"\n')
        refusing.chmod(0o755)
        monkeypatch.setenv(SCONTROL_ENV, str(refusing))
        refused = SlurmBackend().release_nodes(job, other)
        assert list(refused) == ["release_error"], refused
        assert refused["release_error"].startswith(f"scontrol update JobId={job} NodeList=...: ")
        assert "Access/permission denied" in refused["release_error"] and "\n" not in refused["release_error"]
        assert expand_hosts(job_info(job)["NodeList"]) == held
        monkeypatch.delenv(SCONTROL_ENV)
        assert SlurmBackend().release_nodes(job, other) == {"released": other, "nodes_held": 1}
        assert expand_hosts(job_info(job)["NodeList"]) == [info["BatchHost"]]
    finally:
        subprocess.run(["scancel", job], capture_output=True)


def test_the_node_seconds_of_a_shrunk_allocation_follow_its_sizes() -> None:
    """A restart gave a node back (3 → 2 held): the first step's share counts 3 nodes, the rest of the
    allocation what Slurm counted for each size."""
    events = [{"event": "start", "time": 100.0, "began": 95.0, "step": 0, "world_size": 4, "job_id": "7",
               "restart_count": 0},
              {"event": "restart", "time": 200.0, "fault_time": 198.0, "nodes_held": 2, "job_id": "7",
               "restart_count": 0},
              {"event": "start", "time": 210.0, "began": 205.0, "step": 10, "world_size": 4, "job_id": "7",
               "restart_count": 0}]
    sizes = [{"JobID": "7", "State": "RESIZING", "NNodes": "3", "ElapsedSeconds": 110.0, "Attempt": 0,
              "Submit": "2026-11-28T10:00:00", "Start": "2026-11-28T10:00:05"},
             {"JobID": "7", "State": "COMPLETED", "NNodes": "2", "ElapsedSeconds": 300.0, "Attempt": 0,
              "Submit": "2026-11-28T10:01:55", "Start": "2026-11-28T10:01:55"}]
    rows = attempt_rows(events, [], 3, 20, sizes)
    assert [(r["launch"], r["nodes"], r["allocated_node_s"]) for r in rows] == [(0, 3, 330.0), (1, 2, 600.0)]
    assert rows[0]["queue_s"] == 5.0 and rows[1]["restart_s"] == 7.0  # the queue from the first size's times
    # a hang after the shrink, then a requeue: Slurm's last record runs on through the queue and the next run
    # (900 s here); it counts until the requeue (200 s after the resize began it)
    resized_at = datetime.datetime.fromtimestamp(1_800_000_200).isoformat(timespec="seconds")
    moved = [{**e, "time": e["time"] + 1_800_000_000, **({"began": e["began"] + 1_800_000_000}
                                                         if "began" in e else {})} for e in events]
    requeued = [*moved, {"event": "hang", "time": 1_800_000_398.0, "job_id": "7"},
                {"event": "requeue", "time": 1_800_000_400.0, "reason": "hang", "job_id": "7",
                 "restart_count": 0}]
    waited = [sizes[0], {**sizes[1], "State": "REQUEUED", "ElapsedSeconds": 900.0, "Start": resized_at}]
    rows = attempt_rows(requeued, [], 3, 20, waited)
    assert [r["allocated_node_s"] for r in rows] == [330.0, 3 * 110.0 + 2 * 200.0 - 330.0]


def test_a_placement_takes_spares_first_then_shrinks_to_its_floor() -> None:
    placement = Placement(nodes=2, tasks_per_node=8, min_nodes=1)
    allocation = ["n1", "n2", "n3"]
    assert placement.choose(allocation, []) == ["n1", "n2"]  # the spare waits
    assert placement.choose(allocation, ["n2"]) == ["n1", "n3"]  # the spare takes n2's place
    assert placement.choose(allocation, ["n2", "n3"]) == ["n1"]  # no spare left: one node, min_nodes allows
    assert placement.choose(allocation, ["n1", "n2", "n3"]) is None
    assert Placement(2, 8, 2).choose(["n1", "n2"], ["n2"]) is None  # min_nodes = nodes: requeue instead
    assert placement.srun_args(["n1", "n3"]) == ("--nodes=2 --ntasks=16 --ntasks-per-node=8 "
                                                 "--nodelist=n1,n3")


def test_the_first_step_keeps_the_jobs_placement_for_its_restarts(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch script's first line is the one channel of the node count: its placement is kept for the
    restarts, and the line a script of older code wrote (no MIN_NODES) keeps the run at its node count."""
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert steps.main(["first", str(tmp_path), "2", "8", "1"]) == 0
    assert steps.read_placement(tmp_path, "77") == Placement(nodes=2, tasks_per_node=8, min_nodes=1)
    assert steps.args_path(tmp_path, "77").read_text() == ("--nodes=2 --ntasks=16 --ntasks-per-node=8 "
                                                           "--nodelist=n1,n2\n")
    assert steps.main(["first", str(tmp_path), "2", "8"]) == 0
    assert steps.read_placement(tmp_path, "77") == Placement(nodes=2, tasks_per_node=8, min_nodes=2)
    assert steps.main(["first", str(tmp_path), "4", "8", "4"]) == 1  # the allocation has 3 nodes
    assert steps.read_placement(tmp_path, "78") is None
