"""A sweep is one job array: every Slurm call about one of its runs names that array task (ARRAY_TASK).

On the real testbed, one task of a two-run sweep is preempted (`scontrol requeue A_0`) and then loses a rank
to SIGKILL (requeued held while its node is excluded, then released): only that task requeues and resumes,
each time on its own id; the other task trains undisturbed to its end.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from bench.faults import rank_record, wait_for
from taehv_slurm.submission import submit_many
from tests.helpers import events, make_cluster, wait_done
from tests.tasks import CountingTask

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def steps_trained(run_dir: Path) -> list[int]:
    path = run_dir / "steps.txt"
    return [int(n) for n in path.read_text().split()] if path.exists() else []


def test_one_task_of_a_sweep_requeues_and_resumes_on_its_own_id(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=10, array_parallelism=2,
                           restart_in_allocation=False)
    hit, other = submit_many([CountingTask(150, step_s=0.1), CountingTask(150, step_s=0.1)], cluster,
                             ["hit", "other"], group_name="sweep")
    array = hit.job_id.split("_")[0]
    assert (hit.job_id, other.job_id) == (f"{array}_0", f"{array}_1")

    wait_for(lambda: len(steps_trained(hit.run_dir)) >= 10, 180, "the first task to train")
    subprocess.run(["scontrol", "requeue", hit.job_id], check=True)  # a preemption of this task alone
    wait_for(lambda: len(events(hit, "start")) >= 2, 180, "the preempted task to start again")
    wait_for(lambda: (rank_record(hit, 0).get("step") or 0) > steps_trained(hit.run_dir)[0] + 5
             and rank_record(hit, 0).get("job_id") == hit.job_id, 180, "the task to train again")
    killed = rank_record(hit, 0)
    os.kill(killed["pid"], signal.SIGKILL)  # a rank lost: requeued held, its node excluded, released

    assert wait_done(hit.job_id, 300) == "COMPLETED", hit.tail(60)
    assert wait_done(other.job_id, 300) == "COMPLETED", other.tail(60)
    preempted, moved = events(hit, "requeue")
    assert (preempted["reason"], preempted["job_id"]) == ("preempted", hit.job_id)
    assert (moved["reason"], moved["job_id"], moved["excluded"]) == ("killed", hit.job_id, [killed["host"]])
    assert "release_error" not in moved and "exclusion_error" not in moved
    starts = events(hit, "start")
    assert [e["job_id"] for e in starts] == [hit.job_id] * 3 and starts[-1]["host"] != killed["host"]
    trained = steps_trained(hit.run_dir)
    assert sorted(set(trained)) == list(range(1, 151)) and trained[-1] == 150

    assert not events(other, "requeue") and [e["job_id"] for e in events(other, "start")] == [other.job_id]
    assert steps_trained(other.run_dir) == list(range(1, 151))  # every step once, in one attempt
