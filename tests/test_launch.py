"""jobs.launch for container platforms: node-level RANK/WORLD_SIZE → one rank per GPU, for real.

Two launcher processes play two nodes (loopback master, a free port), each starting 2 CPU ranks (gloo):
the tiny training and the smoke all-reduce over 4 ranks; a rank that dies takes its node down at once;
SIGTERM saves and a restart resumes; torchrun-started ranks run the task directly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.faults import wait_for
from taehv_slurm.common.config import load_cluster
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime.checkpoint import Checkpointer
from tests.helpers import metrics
from tests.tasks import CountingTask

REPO = Path(__file__).resolve().parents[1]
CLUSTER = ["--cluster", "configs/platform/cluster.yaml", "--set", "torch_threads=1"]
TINY = ["--train", "configs/train/tiny.yaml", "--set", "intervals.val_every=1000",
        "--set", "intervals.ckpt_every=1000"]
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "NODE_RANK", "TAEHV_JOB_ID", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID")


class ExitOnRank3:
    """A task for the failure test: all 4 ranks join, then rank 3 exits with code 7 while the others wait."""

    def __call__(self, ctx) -> None:
        import torch.distributed as dist

        from taehv_slurm.runtime.distenv import init_distributed

        init_distributed(ctx.env, "gloo", timeout_s=120, rendezvous_timeout_s=120)
        if ctx.env.rank == 3:
            (ctx.run_dir / "died_at").write_text(repr(time.time()))
            sys.exit(7)
        dist.barrier()


class CountsForAMinute(CountingTask):
    """The requeue machinery without a model (tests.tasks.CountingTask): 600 steps of 0.1 s."""

    def __init__(self) -> None:
        super().__init__(steps=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(tmp: Path, node: int, nodes: int, port: int, *args: str) -> tuple[subprocess.Popen, Path]:
    """One launcher as the platform starts it on node `node`: node-level RANK / WORLD_SIZE, node 0's
    address."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(RANK=str(node), WORLD_SIZE=str(nodes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TAEHV_JOB_ID=f"test-{port}", PYTHONPATH=str(REPO))
    log = tmp / f"node{node}.log"
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stall a node mid-collective
        proc = subprocess.Popen([sys.executable, "-m", "jobs.launch", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def run_nodes(tmp: Path, nodes: int, *args: str, timeout_s: float = 300) -> list[tuple[int, str]]:
    port = free_port()
    started = [start_node(tmp, n, nodes, port, *args) for n in range(nodes)]
    try:
        codes = [proc.wait(timeout=timeout_s) for proc, _ in started]
    finally:
        for proc, _ in started:
            proc.kill()
    return [(code, log.read_text()) for code, (_, log) in zip(codes, started)]


def test_two_nodes_times_two_ranks_train_tiny(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (code0, out0), (code1, out1) = run_nodes(tmp_path, 2, *CLUSTER, *TINY, "--procs-per-node", "2",
                                             "--run-dir", str(run), "--set", "steps=6",
                                             "--set", "intervals.log_every=2")
    assert code0 == 0 and code1 == 0, out0[-3000:] + out1[-3000:]
    assert "[launch] node 0/2" in out0 and "ranks 0-1 of 4 (2 per node, cpu)" in out0
    assert "[launch] node 1/2" in out1 and "ranks 2-3 of 4 (2 per node, cpu)" in out1
    results = [json.loads(line.split("result: ", 1)[1]) for line in out0.splitlines()
               if line.startswith("[taehv] result: ")]
    assert len(results) == 1 and "result:" not in out1  # global rank 0 only
    assert results[0]["rank"] == 0 and results[0]["world_size"] == 4 and results[0]["step"] == 6
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 4, 6]  # rank 0 writes each step once
    assert all(r["loss"] > 0 for r in rows)
    assert "train step 6/6" in out0 and "train step" not in out1
    step, _, meta = Checkpointer(RunFolder(run).checkpoints).load_latest()
    assert step == 6 and meta["world_size"] == 4 and meta["plan"]["per_gpu_batch"] == 2


def test_smoke_all_reduce_over_four_ranks(tmp_path: Path) -> None:
    outs = run_nodes(tmp_path, 2, *CLUSTER, "--task", "smoke", "--procs-per-node", "2",
                     "--bandwidth-mib", "1", "--run-dir", str(tmp_path / "smoke"))
    assert all(code == 0 for code, _ in outs), "".join(out[-2000:] for _, out in outs)
    facts = [json.loads(line.split("smoke: ", 1)[1]) for _, out in outs for line in out.splitlines()
             if line.startswith("[taehv] smoke: ")]
    assert sorted(f["rank"] for f in facts) == [0, 1, 2, 3]
    for f in facts:
        assert (f["world_size"] == 4 and f["sum"] == 6.0 and f["backend"] == "gloo"
                and f["source"] == "torchrun")
        assert f["node_rank"] == f["rank"] // 2 and f["local_rank"] == f["rank"] % 2
        assert f["bus_bandwidth_gbps"]["1"] > 0


def test_a_rank_that_dies_takes_its_node_down_with_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    port = free_port()
    started = [start_node(tmp_path, n, 2, port, *CLUSTER, "--task", "tests.test_launch:ExitOnRank3",
                          "--procs-per-node", "2", "--run-dir", str(run)) for n in range(2)]
    ended: dict[int, float] = {}
    try:
        def both_ended() -> bool:
            for n, (proc, _) in enumerate(started):
                if n not in ended and proc.poll() is not None:
                    ended[n] = time.time()
            return len(ended) == 2
        wait_for(both_ended, 180, "both launchers to exit", poll_s=0.05)
    finally:
        for proc, _ in started:
            proc.kill()
    (node0, log0), (node1, log1) = started
    out1 = log1.read_text()
    assert node1.returncode == 1, out1[-3000:]  # the run failed (docs/errors.md's exit codes); the rank's own
    # code is in the line that names it
    errors = [line for line in out1.splitlines() if line.startswith("error: node")]
    assert errors == ["error: node 1: rank 3 (local rank 1) exited with code 7; stopped the 1 other rank(s) "
                      "of this node; rank 3's output above says why"]
    died_at = float((run / "died_at").read_text())
    assert ended[1] - died_at < 10, f"node 1 took {ended[1] - died_at:.1f} s to go down"
    # Node 0's ranks lose their peer in the barrier, fail, and take node 0 down as well (no hang).
    assert node0.returncode != 0 and "error: node 0: rank" in log0.read_text()


def test_sigterm_saves_and_a_restart_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*CLUSTER, *TINY, "--procs-per-node", "2", "--run-dir", str(run), "--set", "intervals.log_every=1",
            "--set", "kill_wait_s=30"]
    port = free_port()
    proc, log = start_node(tmp_path, 0, 1, port, *args, "--set", "steps=300")
    try:
        wait_for(lambda: len([r for r in metrics(run) if "loss" in r]) >= 3, 240, "step 3")
        proc.send_signal(signal.SIGTERM)  # what the platform sends before it stops the pod
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    out = log.read_text()
    assert code == 143, out[-3000:]
    assert ("caught SIGTERM; sending SIGTERM to 2 rank(s)" in out
            and "exiting 143 so the platform restarts" in out)
    saved = Checkpointer(RunFolder(run).checkpoints).latest_step()
    assert saved is not None and saved >= 3
    # On a platform the platform restarts the node: the run records that it saved and exited for that
    # restart (not a requeue, which nothing here could do or confirm).
    stops = [e for e in RunFolder(run).events().read() if e["event"] == "exited_for_restart"]
    assert [(e["reason"], e["step"]) for e in stops] == [("preempted", saved)]

    # The platform restarts the pod: same command, same run folder → resumes from `latest` and finishes.
    (code, out), = run_nodes(tmp_path, 1, *args, "--set", f"steps={saved + 2}")
    assert code == 0, out[-3000:]
    assert f"resumed from step {saved}" in out
    steps = [r["step"] for r in metrics(run) if "loss" in r]
    assert steps == list(range(1, saved + 3))  # each step once, none lost


def test_ctrl_c_saves_and_exits_130(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               TAEHV_JOB_ID="ctrl-c", PYTHONPATH=str(REPO))
    # as from a terminal: SIGINT at its default action (a shell running tests in the background ignores it)
    proc = subprocess.Popen([sys.executable, "-m", "jobs.launch", *CLUSTER, "--procs-per-node", "1",
                             "--task", "tests.test_launch:CountsForAMinute", "--run-dir", str(run)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: (run / "steps.txt").exists(), 120, "the first step")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "all ranks exited after SIGINT; exiting 130" in out
    assert Checkpointer(RunFolder(run).checkpoints).latest_step() is not None  # it saved before it exited


def test_torchrun_started_ranks_run_the_task_directly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2",
                          "-m", "jobs.launch", *CLUSTER, "--task", "smoke", "--set", "device=cpu",
                          "--run-dir", str(tmp_path / "smoke")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    facts = [json.loads(line.split("smoke: ", 1)[1]) for line in out.stdout.splitlines()
             if line.startswith("[taehv] smoke: ")]
    assert sorted(f["rank"] for f in facts) == [0, 1] and {f["sum"] for f in facts} == {1.0}
    assert "[launch]" not in out.stdout  # no second layer of processes


def test_platform_config_and_k8s_manifest_agree() -> None:
    cluster = load_cluster(REPO / "configs/platform/cluster.yaml")
    service, job = yaml.safe_load_all((REPO / "configs/platform/k8s-job.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["WORLD_SIZE"]["value"])
    assert "job-completion-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert env["MASTER_ADDR"]["value"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert container["command"][:2] == ["taehv", "launch"]
    assert pod["terminationGracePeriodSeconds"] >= cluster.kill_wait_s  # time for the ranks to save
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert cluster.job_dir in mounts  # checkpoints on the volume every pod shares
