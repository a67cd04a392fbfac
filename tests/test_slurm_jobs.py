"""Jobs on the real multi-node Slurm testbed: the 2 × 8 smoke job, tiny training on 2 nodes, the CLI."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm import slurm
from taehv_slurm.common.config import load_cluster, load_train
from taehv_slurm.executor import SubmissionError, make_executor
from taehv_slurm.runtime.smoke import SmokeTask
from taehv_slurm.submission import submit
from taehv_slurm.training import submit_training
from tests.helpers import REPO, final_state, make_cluster, metrics, quick_train, wait_done

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def test_two_nodes_times_eight_tasks_through_make_executor(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path, nodes=2, gpus_per_node=8, rendezvous_timeout_s=120)
    executor = make_executor(cluster, tmp_path / "submitit")
    job = executor.submit(SmokeTask(backend="gloo"))
    facts = job.results()
    assert len(facts) == 16
    assert sorted(f["rank"] for f in facts) == list(range(16))
    hosts = {f["host"] for f in facts}
    assert len(hosts) == 2 and hosts <= {"tb1", "tb2", "tb3"}  # any two of the testbed's three nodes
    for host in hosts:
        assert sorted(f["local_rank"] for f in facts if f["host"] == host) == list(range(8))
    assert all(f["sum"] == 120.0 and f["world_size"] == 16 and f["source"] == "slurm" for f in facts)
    assert {f["slurm_gpus_on_node"] for f in facts} == {"8"}  # --gres=gpu:8 reached every task


def test_sbatch_rejection_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()  # a job_dir that exists keeps what it holds
    for job_dir in (tmp_path / "new", tmp_path / "kept"):
        for overrides, needle in (({"partition": "nosuchpartition"}, "invalid partition"),
                                  ({"gpus_per_node": 16}, "requested node configuration is not available")):
            cluster = make_cluster(job_dir, **overrides)
            with pytest.raises(SubmissionError) as err:
                submit(SmokeTask(), cluster, "rejected", requeueable=False)
            message = str(err.value)
            assert "\n" not in message and message.startswith("sbatch rejected the job:")
            assert needle in message.lower()
    assert (sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
            and list((tmp_path / "kept").iterdir()) == [])


# Build and pickle a TrainTask as the submitting side does, and load it as a rank does, each in a process of
# its own: which modules each imported, and which classes the pickle names.
PICKLE_A_TRAIN_TASK = """
import json, pickle, sys
from taehv_slurm.common.config import load_cluster, load_train
from taehv_slurm.trainer.task import TrainTask
train, cluster = load_train(sys.argv[2]), load_cluster(sys.argv[3], job_dir="runs")
with open(sys.argv[1], "wb") as f:
    pickle.dump(TrainTask(train.to_dict(), cluster.runtime()), f)
print(json.dumps({"torch": "torch" in sys.modules}))
"""
LOAD_A_TRAIN_TASK = """
import dataclasses, json, pickle, sys
named = []
class Recording(pickle.Unpickler):
    def find_class(self, module, name):
        named.append([module, name])
        return super().find_class(module, name)
with open(sys.argv[1], "rb") as f:
    task = Recording(f).load()
print(json.dumps({"torch": "torch" in sys.modules, "named": named, "train": task.train,
                  "runtime": dataclasses.asdict(task.runtime)}))
"""


def test_train_task_pickles_without_torch(tmp_path: Path) -> None:
    """The task every rank runs holds plain values only: pickled where you submit and loaded on a rank, it
    imports no torch either way, names only its own class and the runtime settings', and carries the
    config and settings unchanged."""
    train, cluster = REPO / "configs/train/tiny.yaml", REPO / "configs/cluster/testbed.yaml"
    pickled = tmp_path / "task.pkl"
    outputs = []
    for code, args in ((PICKLE_A_TRAIN_TASK, (pickled, train, cluster)), (LOAD_A_TRAIN_TASK, (pickled,))):
        done = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(json.loads(done.stdout))
    written, loaded = outputs
    assert not written["torch"] and not loaded["torch"]
    assert sorted(map(tuple, loaded["named"])) == [("taehv_slurm.common.config", "RuntimeSettings"),
                                                   ("taehv_slurm.trainer.task", "TrainTask")]
    assert loaded["train"] == json.loads(json.dumps(load_train(train).to_dict()))
    runtime = load_cluster(cluster, job_dir="runs").runtime()
    assert loaded["runtime"] == {**dataclasses.asdict(runtime), "compile_cache_dir": str(
        tmp_path / "runs" / "compile-cache")}  # relative to where it was built


def test_tiny_training_on_two_nodes(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path, nodes=2, gpus_per_node=2, time_min=20)
    train = quick_train(steps=30, **{"intervals.log_every": 5, "intervals.val_every": 30, "batch.per_gpu": 2})
    handle = submit_training(cluster, train, "two-nodes")[0]
    assert wait_done(handle.job_id, 600) == "COMPLETED", handle.tail(40)
    results = handle.results()
    assert (len(results) == 4 and {r["world_size"] for r in results} == {4}
            and {r["step"] for r in results} == {30})
    rows = [r for r in metrics(handle.run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]  # rank 0 only: each step once
    assert rows[-1]["loss"] < rows[0]["loss"]
    step, state, meta = final_state(handle.run_dir)
    assert step == 30 and meta["world_size"] == 4 and meta["plan"]["grad_accum"] == 1
    logs = {r: handle.tail(200, rank=r) for r in range(4)}
    assert "train step 30/30" in logs[0]
    assert all("train step" not in logs[r] for r in (1, 2, 3))  # only rank 0 logs progress
    assert not list(Path(handle.run_dir).glob("metrics*.jsonl"))[1:]  # one metrics file


def test_cli_dry_run_imports_no_torch() -> None:
    # the shipped config's prepared data is not on this machine: its check is skipped, as on a login node
    code = ("import sys, runpy; sys.argv=['jobs.submit','--nodes','8','--dry-run','--skip-data-checks'];"
            "\ntry:\n    runpy.run_module('jobs.submit', run_name='__main__')\n"
            "except SystemExit as done:\n    print('exit code', done.code)\n"
            "print('TORCH_LOADED' if 'torch' in sys.modules else 'NO_TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=60).stdout
    assert ("#SBATCH --nodes=8" in out and "#SBATCH --ntasks-per-node=8" in out
            and "#SBATCH --gres=gpu:8" in out)
    assert ("world size 64" in out
            and "effective batch     128 = 64 ranks × 2; micro-batch 2, 1 per step" in out)
    assert out.strip().splitlines()[-2:] == ["exit code 0", "NO_TORCH"], out[-2000:]


def test_cli_submit_smoke_and_local_training(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "jobs.submit", "--cluster", "configs/cluster/testbed.yaml",
                          "--task", "smoke",
                          "--nodes", "2", "--gpus-per-node", "2", "--set", f"job_dir={tmp_path}", "--follow"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "submitted job" in out.stdout and "ended: COMPLETED" in out.stdout
    assert out.stdout.count("'sum': 6.0") == 4
    local = subprocess.run([sys.executable, "-m", "jobs.submit", "--local",
                            "--train", "configs/train/tiny.yaml", "--set", "steps=20",
                            "--set", "intervals.log_every=5", "--set", f"job_dir={tmp_path}"],
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-2000:]
    assert "train step 20/20" in local.stdout and "ended: COMPLETED" in local.stdout


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodse: 2\n")
    out = subprocess.run([sys.executable, "-m", "jobs.submit", "--cluster", str(bad), "--dry-run"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: {bad}: unknown key 'nodse' (did you mean 'nodes'?)"
    out = subprocess.run([sys.executable, "-m", "jobs.submit", "--nodes", "17", "--dry-run"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "use at most 16 node(s) × 8" in out.stderr


def test_the_commands_a_job_requeues_itself_with_outlive_the_requeues_sigterm() -> None:
    # A job's own `scontrol requeue` is among the processes the requeue's SIGTERM reaches; it used to die
    # with exit code -15 now and then, and a requeue that happened was recorded as failed (the time-limit
    # test caught it). Here the SIGTERM comes from the command itself, mid-way, every time.
    command = ["sh", "-c", "kill -TERM $$; echo answered"]
    assert slurm.run(command, survive_term=True) == slurm.Answer(True, "answered\n")
    killed = slurm.run(command)
    assert not killed.ok and killed.error == "exit code -15"


def test_a_running_job_is_past_its_end_time_only_once_its_limit_has_come(tmp_path: Path) -> None:
    """`scontrol show job`'s EndTime read as the time limit's moment (the node's local time, as Slurm prints
    it), for a job still RUNNING: how a rank tells a SIGTERM at the time limit from a preemption when the
    controller has not recorded Reason=TimeLimit yet. Once cancelled, a job's EndTime is when it ended:
    no time limit."""
    sbatch = subprocess.run(["sbatch", "--parsable", "--time=1", f"--output={tmp_path / 'out'}",
                             "--wrap", "sleep 300"], capture_output=True, text=True, check=True)
    job_id = sbatch.stdout.strip().split(";")[0]
    try:
        def running() -> dict[str, str] | None:  # a failed question (an Answer) is asked again
            info = slurm.job_info(job_id)
            return info if isinstance(info, dict) and info.get("JobState") == "RUNNING" else None

        info = wait_for(running, 60, "the job to run")
        left = datetime.datetime.fromisoformat(info["EndTime"]).timestamp() - time.time()
        assert 0 < left <= 61  # a 1-minute limit, in this machine's time zone
        assert not slurm.past_its_end_time(info, time.time())
        assert slurm.past_its_end_time(info, time.time() + left + 1)
    finally:
        subprocess.run(["scancel", job_id], check=True)
    assert wait_done(job_id, 60) == "CANCELLED"
    cancelled = slurm.job_info(job_id)
    assert isinstance(cancelled, dict), cancelled
    assert not slurm.past_its_end_time(cancelled, time.time() + 120)


# A rank's SIGTERM handler, then 30 quick commands run with survive_term, as after a requeuehold, once the
# storm has reached this process; it says how many SIGTERMs it caught while the commands ran.
UNDER_A_SIGTERM_STORM = """
import signal, sys, time
from taehv_slurm import slurm
from taehv_slurm.common.config import load_cluster, load_train
caught = []
signal.signal(signal.SIGTERM, lambda *_: caught.append(1))
print("ready", flush=True)
sys.stdin.readline()  # the storm has begun
deadline = time.monotonic() + 30
while not caught and time.monotonic() < deadline:
    time.sleep(0.001)
before = len(caught)
answers = [slurm.run(["/bin/echo", "answered"], survive_term=True) for _ in range(30)]
print(sum(not a.ok for a in answers), sorted({a.error for a in answers if not a.ok}), flush=True)
print("caught while the commands ran:", len(caught) - before, flush=True)
"""


STORM = """
import os, signal, sys
while True:
    os.killpg(int(sys.argv[1]), signal.SIGTERM)  # until the group is gone
"""


def test_a_sigterm_before_the_shells_trap_does_not_end_the_command() -> None:
    # Slurm's SIGTERM to every process of the job can reach a command just forked, before its shell has
    # set the trap: on the testbed `scontrol release` after a requeuehold died so (exit code -15) and the
    # job stayed held. Here SIGTERM reaches the whole process group as fast as it can be sent (before the
    # fix, 64 and 87 of 100 such commands died).
    runner = subprocess.Popen([sys.executable, "-c", UNDER_A_SIGTERM_STORM], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    storm = None
    try:
        assert runner.stdout.readline() == "ready\n"
        storm = subprocess.Popen([sys.executable, "-c", STORM, str(runner.pid)], stderr=subprocess.DEVNULL)
        out, _ = runner.communicate("go\n", timeout=120)
    finally:
        if storm is not None:
            storm.kill()
            storm.wait()
        runner.kill()
    failed, caught = out.splitlines()
    assert failed == "0 []", out
    assert int(caught.removeprefix("caught while the commands ran: ")) > 0, out  # the storm was on
