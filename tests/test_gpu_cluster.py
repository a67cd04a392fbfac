"""The whole Slurm path on real GPUs: a Slurm cluster of two (or three) nodes on one host with GPUs, each node
its own hostname and its share of the GPUs (tests/slurm_testbed_gpus.py), driven through the user's commands.

Marked `gpu_cluster`: skipped where this host has no GPU (CI). On a GPU machine, as root:

    python -m tests.slurm_testbed start --dir /tmp/taehv-gpu-cluster --nodes 2 --real-gpus --no-accounting \
        [--slurm-debs DIR]            # Debian 12's .deb files where Slurm is not installed
    . /tmp/taehv-gpu-cluster/env.sh && TAEHV_GPU_CLUSTER=/tmp/taehv-gpu-cluster \
        python -m pytest -m gpu_cluster -n 0 -p no:cacheprovider tests/test_gpu_cluster.py

(`--nodes 3` and TAEHV_GPU_CLUSTER_NODES=3 for the spare-node tests; on a host with fewer GPUs than nodes the
nodes take turns on them, which is right for what crosses nodes and not for speed.)

- each node's tasks get that node's GPUs, and the nodes' GPUs are all of the host's, none twice (unless the
  host has fewer GPUs than nodes);
- the classic launch mistakes, for real: more tasks per node than the node has GPUs is refused by Slurm with
  one line naming the fix; 2 × N ranks launched as 1 × 2N (the mismatch allowed on purpose) fails at its
  first rank without a GPU with one line naming the launch, not CUDA's "invalid device ordinal";
- a 2-node training crosses hosts: NCCL connects the nodes through NET/Socket and the GPUs of one node through
  P2P, and the ranks run with the plan's NCCL settings.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.faults import rank_record, wait_for
from taehv_slurm.common.config import load_cluster, load_train
from taehv_slurm.common.plan import plan_for_cluster
from taehv_slurm.common.runfolder import RunFolder
from tests.helpers import REPO, job_state, metrics, read_strictly
from tests.slurm_testbed import Testbed
from tests.slurm_testbed_gpus import host_gpus, shares_gpus

CLUSTER = REPO / "configs/cluster/gpu_testbed.yaml"
SHIPPED = REPO / "configs/train/taehv.yaml"
pytestmark = [pytest.mark.gpu_cluster, pytest.mark.timeout(900),
              pytest.mark.skipif(not host_gpus(), reason="needs a host with a GPU")]
NODES = int(os.environ.get("TAEHV_GPU_CLUSTER_NODES", "2"))


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[Testbed]:
    """The GPU cluster TAEHV_GPU_CLUSTER names (started beforehand, left running), else one started here."""
    given = os.environ.get("TAEHV_GPU_CLUSTER")
    bed = Testbed(given or "/tmp/taehv-gpu-cluster", nodes=NODES, accounting=False, gpu_devices=host_gpus(),
                  cpus_per_node=max(1, (os.cpu_count() or 2) // NODES))
    if not given:
        bed.start()
    with pytest.MonkeyPatch.context() as environ:
        for key, value in bed.env.items():
            environ.setenv(key, value)
        yield bed
    if not given:
        bed.stop()


def taehv(*args: str, job_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m taehv_slurm ARGS` on the GPU cluster's config, as a user runs it."""
    argv = [sys.executable, "-m", "taehv_slurm", *args, "--cluster", str(CLUSTER),
            "--set", f"job_dir={job_dir}"]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                              str(REPO), os.environ.get("PYTHONPATH")]))})


def cpus_each(bed: Testbed, tasks_per_node: int) -> list[str]:
    """The `--set` of cpus_per_task that fits `tasks_per_node` tasks on a node (14 where there is room)."""
    return ["--set", f"cpus_per_task={min(14, bed.cpus_per_node // tasks_per_node)}"]


def small_shipped_run(steps: int) -> list[str]:
    """`--set`s that make configs/train/taehv.yaml a short run on synthetic clips (no shards needed)."""
    sets = {"data.source": "synthetic", "data.height": 128, "data.width": 192, "data.val_clips": 4,
            "steps": steps, "intervals.log_every": 2, "intervals.val_every": 100_000,
            "intervals.ckpt_every": 100_000, "optim.warmup_steps": 2}
    return ["--train", str(SHIPPED),
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


def test_each_node_runs_on_its_own_share_of_the_gpus(gpu_cluster: Testbed) -> None:
    per_node = gpu_cluster.gpus_per_node
    probe = ("import socket, torch; print(socket.gethostname(), sorted(str(torch.cuda.get_device_properties("
             "i).uuid) for i in range(torch.cuda.device_count())))")
    done = subprocess.run(["srun", f"-N{NODES}", f"--ntasks-per-node={per_node}", f"--gres=gpu:{per_node}",
                           sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, set[str]] = {}
    for line in done.stdout.splitlines():
        host, uuids = line.split(" ", 1)
        seen.setdefault(host, set()).update(ast.literal_eval(uuids))
    assert sorted(seen) == gpu_cluster.node_names
    assert all(len(u) == per_node for u in seen.values()), seen
    every = [u for uuids in seen.values() for u in uuids]
    if shares_gpus(gpu_cluster.gpu_shares):  # fewer GPUs than nodes: all of them, in turn
        assert len(set(every)) == len(host_gpus()), seen
    else:
        assert len(set(every)) == len(every), f"two nodes were given the same GPU: {seen}"
        assert len(every) == len(host_gpus())


def test_more_tasks_per_node_than_gpus_is_refused_with_one_line(gpu_cluster: Testbed, tmp_path: Path) -> None:
    too_many = 2 * gpu_cluster.gpus_per_node  # and CPUs enough for them: only the GPUs are missing
    done = taehv("submit", "--nodes", "1", "--gpus-per-node", str(too_many), *small_shipped_run(4),
                 "--set", f"cpus_per_task={gpu_cluster.cpus_per_node // too_many}", "--name", "too-many",
                 job_dir=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sbatch rejected the job: "), done.stderr[-2000:]
    assert "gpus_per_node" in last and "Traceback" not in done.stderr


def test_two_nodes_launched_as_one_fails_at_once_with_one_line(gpu_cluster: Testbed, tmp_path: Path) -> None:
    gpus = gpu_cluster.gpus_per_node
    done = taehv("submit", "--nodes", "1", "--gpus-per-node", str(gpus), "--set",
                 f"tasks_per_node={2 * gpus}", "--set", "allow_task_gpu_mismatch=true", *small_shipped_run(4),
                 "--set", f"cpus_per_task={gpu_cluster.cpus_per_node // (2 * gpus)}", "--name", "one-as-two",
                 "--follow", job_dir=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    # the first rank without a GPU names the launch; the job ends FAILED, and no rank reached CUDA's error
    said = done.stdout + done.stderr
    assert re.search(rf"rank \d+ has local_rank \d+ but tb\d shows {gpus} GPU\(s\): this launch puts "
                     rf"{2 * gpus} tasks on each of 1 node\(s\)", said), said[-3000:]
    assert "FAILED" in done.stdout
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "one-as-two").rglob("*_log.out"))
    assert "invalid device ordinal" not in logs


def test_a_two_node_run_crosses_hosts_over_sockets_and_nvlink_inside(gpu_cluster: Testbed,
                                                                     tmp_path: Path) -> None:
    gpus = gpu_cluster.gpus_per_node
    done = taehv("submit", "--nodes", "2", "--gpus-per-node", str(gpus), *small_shipped_run(6),
                 *cpus_each(gpu_cluster, gpus),
                 "--set", "env.NCCL_DEBUG=INFO", "--name", "crossing", "--follow", job_dir=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    run_dir = tmp_path / "crossing"
    assert [r["step"] for r in metrics(run_dir) if "loss" in r][-1] == 6
    logs = {p.name: p.read_text(errors="replace") for p in RunFolder(run_dir).submitit.glob("*_log.out")}
    text = "".join(logs.values())
    # NCCL's own channel lines: ranks of different nodes through the socket transport, of one node through P2P
    assert re.search(r"via NET/Socket", text), "no channel between the nodes went through sockets"
    if gpus > 1:
        assert re.search(r"via P2P", text), "no channel inside a node went through P2P"
    plan = plan_for_cluster(load_cluster(CLUSTER, nodes=2, gpus_per_node=gpus), load_train(SHIPPED))
    settings = re.search(r"NCCL settings: (.*)", text)
    assert settings, "rank 0 did not log its NCCL settings"
    got = dict(kv.split("=", 1) for kv in settings.group(1).split())
    assert {k: got.get(k) for k in plan.nccl_env} == plan.nccl_env
    assert got.get("NCCL_NVLS_ENABLE") == "0"  # the cluster config's env reached the ranks too


def test_the_run_and_preflight_say_which_network_nccl_chose_between_the_nodes(gpu_cluster: Testbed,
                                                                            tmp_path: Path) -> None:
    """No NCCL_DEBUG of the user's: each attempt records and logs what NCCL chose between the nodes (here,
    separate hosts of one machine, sockets), and `preflight --job` reports it with the bus bandwidth."""
    gpus = gpu_cluster.gpus_per_node
    done = taehv("submit", "--nodes", "2", "--gpus-per-node", str(gpus), *small_shipped_run(4),
                 *cpus_each(gpu_cluster, gpus), "--set", "engine.compile=false", "--name", "transport",
                 "--follow", job_dir=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    (attempt,) = read_strictly(RunFolder(tmp_path / "transport").attempts())
    net = attempt["network"]
    assert (net["backend"], net["transport"], net["nodes"]) == ("nccl", "Socket", 2), net
    assert net["devices"] and all(":" in d for d in net["devices"])  # the interface and its address
    log = RunFolder(tmp_path / "transport").submitit.glob("*_0_log.out")
    assert "network between the ranks: nccl over Socket (" in "".join(p.read_text() for p in log)
    checked = taehv("preflight", "--nodes", "2", "--gpus-per-node", str(gpus), "--job",
                    "--bandwidth-mib", "16", *small_shipped_run(4), *cpus_each(gpu_cluster, gpus),
                    job_dir=tmp_path)
    row = next((line for line in checked.stdout.splitlines() if line.startswith("network ")), "")
    assert re.search(r"nccl over Socket \(.+\); [\d.]+ GB/s bus bandwidth at 16 MiB", row), checked.stdout


# ------------------------------------------------------------------------------ faults, from outside
# Each run: the shipped config made small (synthetic 128×192 clips), checkpoints every 5 steps, a hang floor
# of 30 s, on both nodes with one GPU each (two such runs fit the 4-GPU host at once).
FAULT_SETS = {"intervals.ckpt_every": 5, "hang_floor_s": 30, "heartbeat_s": 3, "min_nodes": 1}

def named_within(fault: str) -> float:
    """Seconds from a fault to its verdict (docs/failures.md): a stop, the hang floor noticed within a
    heartbeat; a kill, the surviving ranks' save grace; each with 10 s of margin."""
    kill_wait_s = load_cluster(CLUSTER).kill_wait_s  # the peer of a killed rank spends its save grace on it
    floor = FAULT_SETS["hang_floor_s"] if fault == "stopped" else kill_wait_s
    return floor + FAULT_SETS["heartbeat_s"] + 10


def training_again_within(fault: str, first_step: dict) -> float:
    """Seconds from a fault to the first step after its restart: a minute (a stop: after its verdict's bound)
    plus the new step's own start-up."""
    found = named_within("stopped") if fault == "stopped" else 0
    return found + 60 + first_step["seconds"]


def first_step_after(run_dir: Path, restart: dict) -> dict:
    return wait_for(lambda: [e for e in run_events(run_dir, "first_step")
                             if e["segment"] == restart["segment"] + 1], 300, "training after the restart")[0]


def fault_run(bed: Testbed, name: str, job_dir: Path, steps: int, *extra: str) -> str:
    """Submit a 2-node run for a fault test (a node's CPUs shared by as many as it has GPUs); its job id."""
    sets = [a for k, v in FAULT_SETS.items() for a in ("--set", f"{k}={v}")]
    done = taehv("submit", "--nodes", "2", "--gpus-per-node", "1", *small_shipped_run(steps), *sets,
                 *cpus_each(bed, bed.gpus_per_node), *extra,
                 "--name", name, job_dir=job_dir)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return re.search(r"submitted job (\d+)", done.stdout)[1]


def run_events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_strictly(RunFolder(run_dir).events(), missing_ok=True) if e["event"] == kind]


def final_state(job_id: str) -> str:
    return wait_for(lambda: (s := job_state(job_id)) in ("COMPLETED", "FAILED", "CANCELLED") and s, 900,
                    f"job {job_id} to end")


def logged_once(run_dir: Path, steps: int) -> bool:
    """Every logged step up to `steps` once (none lost beyond a checkpoint, none trained twice)."""
    kept = [r["step"] for r in metrics(run_dir) if "loss" in r]
    return [s for s in kept if s <= steps] == [1, *range(2, steps + 1, 2)]


def test_fault_preemption_saves_on_both_nodes_and_resumes(gpu_cluster: Testbed, tmp_path: Path) -> None:
    job = fault_run(gpu_cluster, "preempted", tmp_path, 60)
    run_dir = tmp_path / "preempted"
    wait_for(lambda: (rank_record(run_dir, 1).get("step") or 0) >= 15, 600, "training on both nodes")
    subprocess.run(["scontrol", "requeue", job], check=True)
    (requeue,) = wait_for(lambda: run_events(run_dir, "requeue"), 300, "the requeue")
    assert requeue["reason"] == "preempted" and requeue["signal_to_saved_s"] < 10
    assert final_state(job) == "COMPLETED"
    assert run_events(run_dir, "start")[-1]["step"] == requeue["step"] and logged_once(run_dir, 60)


def test_fault_time_limit_saves_requeues_and_resumes(gpu_cluster: Testbed, tmp_path: Path) -> None:
    # the warning (USR2) 30-90 s before 2 min
    job = fault_run(gpu_cluster, "timed", tmp_path, 100_000, "--time-min", "2")
    run_dir = tmp_path / "timed"
    (requeue,) = wait_for(lambda: run_events(run_dir, "requeue"), 600, "the time limit's requeue")
    assert requeue["reason"] == "timeout" and requeue["by"] == "self"
    resumed = wait_for(lambda: run_events(run_dir, "first_step")[1:], 600, "training again")[0]
    assert run_events(run_dir, "start")[-1]["step"] == requeue["step"] == resumed["step"] - 1
    subprocess.run(["scancel", job], check=True)
    assert final_state(job) == "CANCELLED" and logged_once(run_dir, requeue["step"])


def test_fault_stopped_rank_on_node_2_is_named_and_the_run_goes_on_without_it(gpu_cluster: Testbed,
                                                                               tmp_path: Path) -> None:
    job = fault_run(gpu_cluster, "stopped", tmp_path, 120)
    run_dir = tmp_path / "stopped"
    victim = wait_for(lambda: (r := rank_record(run_dir, 1)) and (r.get("step") or 0) >= 12 and r, 600,
                      "training")
    struck_at = time.time()
    os.kill(victim["pid"], signal.SIGSTOP)
    (hang,) = wait_for(lambda: run_events(run_dir, "hang"), 300, "the hang verdict")
    assert (hang["ranks"], hang["hosts"]) == ([1], [victim["host"]])
    assert hang["time"] - struck_at <= named_within("stopped"), hang["time"] - struck_at
    bundle = Path(hang["bundle"])
    assert (bundle / "stacks-rank-0.txt").exists() and (bundle / "nccl-flight-recorder-rank-0.pkl").exists()
    (restart,) = wait_for(lambda: run_events(run_dir, "restart"), 300, "the restart on node 1")
    assert restart["left_out"] == [victim["host"]]
    assert (restart["world_before"], restart["world_after"]) == (2, 1)
    starts = wait_for(lambda: (s := run_events(run_dir, "start"))[-1]["segment"] > restart["segment"] and s,
                      300, "the start on node 1")
    assert starts[-1]["world_size"] == 1 and starts[-1]["effective_batch"] == starts[0]["effective_batch"]
    first = first_step_after(run_dir, restart)
    assert first["time"] - struck_at <= training_again_within("stopped", first), first["time"] - struck_at
    assert final_state(job) == "COMPLETED" and logged_once(run_dir, 120)


def test_fault_every_rank_of_node_2_killed_is_named_and_left_out(gpu_cluster: Testbed,
                                                                 tmp_path: Path) -> None:
    job = fault_run(gpu_cluster, "killed", tmp_path, 120)
    run_dir = tmp_path / "killed"
    victim = wait_for(lambda: (r := rank_record(run_dir, 1)) and (r.get("step") or 0) >= 12 and r, 600,
                      "training")
    struck_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    (killed,) = wait_for(lambda: run_events(run_dir, "killed"), 300, "the kill to be named")
    assert (killed["ranks"], killed["hosts"]) == ([1], [victim["host"]])
    assert killed["time"] - struck_at <= named_within("killed"), killed["time"] - struck_at
    (restart,) = wait_for(lambda: run_events(run_dir, "restart"), 300, "the restart on node 1")
    assert restart["cause"] == "killed" and restart["left_out"] == [victim["host"]]
    first = first_step_after(run_dir, restart)
    assert first["time"] - struck_at <= training_again_within("killed", first), first["time"] - struck_at
    assert final_state(job) == "COMPLETED" and logged_once(run_dir, 120)


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_fault_spare_node_takes_the_place_of_a_lost_one_inside_the_allocation(gpu_cluster: Testbed,
                                                                              tmp_path: Path,
                                                                              fault: str) -> None:
    """2 nodes + 1 spare: the second node's rank SIGKILLed (a node taken away) or SIGSTOPped (a stuck GPU);
    the job starts again on the spare — same job id, no requeue, world size kept — within a minute plus
    the new step's start-up (a stop: plus the hang floor and a heartbeat)."""
    if gpu_cluster.nodes < 3:
        pytest.skip("a spare node needs a 3-node GPU cluster (--nodes 3, TAEHV_GPU_CLUSTER_NODES=3)")
    job = fault_run(gpu_cluster, f"spare-{fault}", tmp_path, 120, "--spare-nodes", "1")
    run_dir = tmp_path / f"spare-{fault}"
    victim = wait_for(lambda: (r := rank_record(run_dir, 1)) and (r.get("step") or 0) >= 12 and r, 600,
                      "training")
    struck_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    (restart,) = wait_for(lambda: run_events(run_dir, "restart"), 300, "the restart on the spare")
    first = first_step_after(run_dir, restart)
    assert restart["cause"] == ("killed" if fault == "killed" else "hang")
    assert restart["left_out"] == [victim["host"]] and victim["host"] not in restart["nodes"]
    assert restart["world_before"] == restart["world_after"] == 2  # the spare keeps the world size
    assert first["time"] - struck_at <= training_again_within(fault, first), (first["time"] - struck_at,
                                                                               first["seconds"])
    assert not run_events(run_dir, "requeue") and str(first["job_id"]) == job  # it never left the allocation
    assert final_state(job) == "COMPLETED" and logged_once(run_dir, 120)
    ends = {rank_record(run_dir, r)["host"] for r in range(2)}  # the last step's ranks: the spare among them
    assert victim["host"] not in ends and len(ends) == 2


def test_fault_resume_two_nodes_then_one_then_two_keeps_the_losses(gpu_cluster: Testbed,
                                                                   tmp_path: Path) -> None:
    for nodes, steps in ((2, 20), (1, 40), (2, 60)):
        done = taehv("submit", "--nodes", str(nodes), "--gpus-per-node", "1", *small_shipped_run(steps),
                     *cpus_each(gpu_cluster, 1),
                     "--name", "resumed", "--follow", job_dir=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:]
    run_dir = tmp_path / "resumed"
    starts = run_events(run_dir, "start")
    assert [(s["step"], s["world_size"]) for s in starts] == [(0, 2), (20, 1), (40, 2)]
    losses = {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}
    for at in (20, 40):  # the step after each resume continues the curve (bf16, another world size)
        assert abs(losses[at + 2] - losses[at]) <= 0.1 * losses[at], (at, losses[at], losses[at + 2])
