"""DistEnv from every launcher's variables, and init_distributed with real gloo processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taehv_slurm.runtime.distenv import (
    PORT_BASE,
    PORT_SPAN,
    DistEnv,
    DistributedSetupError,
    check_device_ordinal,
    expand_nodelist,
    port_for_job,
)

REPO = Path(__file__).resolve().parents[1]


def test_slurm_task_env() -> None:
    env = DistEnv.from_environ({
        "SLURM_JOB_ID": "4242", "SLURM_PROCID": "11", "SLURM_LOCALID": "3", "SLURM_NODEID": "1",
        "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "8(x2)",
        "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2",
    })
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (11, 3, 16, 8)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.source) == (1, 2, "gpu007", "slurm")
    assert env.master_port == port_for_job("4242") and env.restart_count == 2
    # docs/security.md: the cluster config's env can set the port (and address) a Slurm job meets at
    moved = DistEnv.from_environ({"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                                  "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "gpu007",
                                  "TAEHV_MASTER_PORT": "23456", "TAEHV_MASTER_ADDR": "10.1.2.3"})
    assert (moved.master_port, moved.master_addr) == (23456, "10.1.2.3") != (port_for_job("4242"), "gpu007")


def test_torchrun_env() -> None:
    env = DistEnv.from_environ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                                "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500", "GROUP_RANK": "1"})
    assert ((env.rank, env.local_rank, env.node_rank, env.num_nodes, env.master_port, env.source)
            == (5, 1, 1, 2, 29500, "torchrun"))


def test_platform_env_is_node_level() -> None:
    # Container platforms: WORLD_SIZE = number of nodes, RANK = node index.
    env = DistEnv.from_environ({"RANK": "2", "WORLD_SIZE": "8", "MASTER_ADDR": "job-0.svc",
                                "MASTER_PORT": "23456"})
    assert (env.source, env.node_rank, env.num_nodes, env.world_size) == ("platform", 2, 8, 8)
    gpu3 = env.for_local_rank(3, 8)
    assert (gpu3.rank, gpu3.local_rank, gpu3.world_size, gpu3.local_world_size) == (19, 3, 64, 8)
    assert gpu3.torchrun_environ()["RANK"] == "19"
    assert DistEnv.from_environ(gpu3.torchrun_environ()).rank == 19  # children read it back as torchrun
    with pytest.raises(DistributedSetupError, match="MASTER_ADDR"):
        DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2"})


def test_single_process() -> None:
    env = DistEnv.from_environ({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


def test_nodelist_forms() -> None:
    assert expand_nodelist("gpu[001-003,007],cpu01") == ["gpu001", "gpu002", "gpu003", "gpu007", "cpu01"]
    assert expand_nodelist("tb[1-2]") == ["tb1", "tb2"]
    assert expand_nodelist("a-node-1,rack[2-3]-gpu[1-2]")[:3] == ["a-node-1", "rack2-gpu1", "rack2-gpu2"]
    with pytest.raises(DistributedSetupError):
        expand_nodelist("gpu[1-")


def test_port_range_and_distinct_jobs() -> None:
    ports = {port_for_job(str(j)) for j in range(100000, 100000 + PORT_SPAN)}
    assert len(ports) == PORT_SPAN and min(ports) == PORT_BASE and max(ports) < 32768
    assert port_for_job("123_4") != port_for_job("123_5")  # array tasks get their own


def test_one_node_sixteen_tasks_fails_with_the_fix() -> None:
    # A common launch mistake: 2 nodes × 8 GPUs launched as 1 node × 16 processes.
    env = DistEnv(rank=9, local_rank=9, world_size=16, local_world_size=16, node_rank=0, num_nodes=1,
                  master_addr="n1", master_port=20000, job_id="1", source="slurm")
    with pytest.raises(DistributedSetupError) as err:
        check_device_ordinal(env, device_count=8)
    message = str(err.value)
    assert "\n" not in message
    assert "local_rank 9" in message and "8 GPU(s)" in message and "16 tasks on each of 1 node(s)" in message
    assert "nodes = 2" in message and "tasks_per_node = gpus_per_node = 8" in message
    check_device_ordinal(DistEnv.from_environ({}), device_count=1)  # rank 0 of 1 GPU is fine


WORKER = """
import json, os, sys
from taehv_slurm.runtime.distenv import DistEnv, init_distributed
import torch, torch.distributed as dist
env = DistEnv.from_environ()
backend = init_distributed(env, "gloo", timeout_s=60, rendezvous_timeout_s=float(os.environ.get("RDV", "60")))
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": env.rank, "sum": t.item(), "backend": backend,
                  "master": os.environ["MASTER_ADDR"]}))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(rank: int, world: int, port: int, extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(REPO), **(extra or {})}
    return subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_init_distributed_real_gloo_processes() -> None:
    port = _free_port()
    procs = [_launch(r, 3, port) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert all(r["sum"] == 6.0 and r["backend"] == "gloo" for r in results)


def test_unreachable_master_fails_in_bounded_time() -> None:
    # Rank 1 of 2 with nobody listening at MASTER_ADDR:MASTER_PORT: a message after ~3 s, not a hang.
    start = time.monotonic()
    proc = _launch(1, 2, _free_port(), {"RDV": "3"})
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rendezvous with 127.0.0.1" in err and "failed after ≤3 s" in err and "rendezvous_timeout_s" in err
    assert elapsed < 30


def test_slurm_task_outranks_leftover_launcher_variables() -> None:
    # sbatch exports the submitting environment: a notebook under torchrun would pass RANK=0 WORLD_SIZE=1.
    slurm = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
             "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "tb[1-2]"}
    stale = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "10.1.1.1",
             "MASTER_PORT": "29500"}
    env = DistEnv.from_environ({**slurm, **stale})
    assert (env.source, env.rank, env.world_size, env.master_addr) == ("slurm", 3, 4, "tb1")
    # torchrun (or jobs.launch) started INSIDE a Slurm step marks its children: then its variables win.
    inner = DistEnv.from_environ({**slurm, **stale, "TORCHELASTIC_RUN_ID": "x"})
    assert (inner.source, inner.world_size) == ("torchrun", 1)


def test_jobs_do_not_inherit_launcher_variables(tmp_path) -> None:
    from taehv_slurm.common.config import load_cluster
    from taehv_slurm.executor import sbatch_preview

    script = sbatch_preview(load_cluster({"partition": "gpu"}), tmp_path)
    unset = next(line for line in script.splitlines() if line.startswith("unset "))
    assert ({"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
            <= set(unset.split()))
