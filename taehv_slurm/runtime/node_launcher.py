"""Container platforms (Kubernetes Job, KubeBrain, ...): one process per node becomes one rank per GPU.

A platform starts ONE process per node and sets WORLD_SIZE = number of nodes, RANK = node index and
MASTER_ADDR / MASTER_PORT = node 0's address. `taehv launch` on each node counts the node's GPUs
(`choose_ranks`: the '1 × 16 on 2 × 8' mistake is caught here), shapes the cluster config for the node
(`for_node`), and runs one rank per GPU with torchrun's variables under the same rank supervisor as the
local backend (`supervise`): stop signals are passed on (the ranks save at the next step) and a rank
that dies takes the node down with one line. torchrun can start the ranks instead (`torchrun
--nproc-per-node 8 -m taehv launch ...`); then each process is one rank and no supervisor runs here.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from taehv_slurm.common.config import ClusterConfig, ConfigError, TrainConfig
from taehv_slurm.common.plan import plan_for
from taehv_slurm.runtime.distenv import DistributedSetupError
from taehv_slurm.runtime.supervisor import RankCommand, Supervisor


def for_node(base: ClusterConfig, ranks_per_node: int, device: str, source: str) -> ClusterConfig:
    """The cluster config shaped for this node: one rank per GPU (gpus_per_node = ranks), or CPU ranks."""
    device = device if device != "auto" else base.device
    cluster = dataclasses.replace(base, device=device, tasks_per_node=ranks_per_node,
                                  gpus_per_node=0 if device == "cpu" else ranks_per_node)
    return cluster.validate(source)


def visible_gpus() -> int:
    """GPUs this node's ranks can use, as torch counts them (CUDA_VISIBLE_DEVICES applies)."""
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/kfd").exists():
        return 0  # no NVIDIA/AMD device files: no GPU, and no need to import torch to learn it
    import torch

    return torch.cuda.device_count()


def choose_ranks(gpus_per_node: int | None, procs_per_node: int | None, device_setting: str, gpus: int,
                 num_nodes: int) -> tuple[int, str]:
    """(ranks per node, "cuda" | "cpu") from the GPUs found and the flags --gpus-per-node /
    --procs-per-node."""
    host = socket.gethostname()
    for flag, value in (("--gpus-per-node", gpus_per_node), ("--procs-per-node", procs_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be ≥ 1, got {value}")
    if procs_per_node is not None:
        if gpus_per_node is not None:
            raise ConfigError("--gpus-per-node and --procs-per-node exclude each other: "
                              "GPU ranks or CPU ranks")
        if device_setting == "cuda":
            raise ConfigError("--procs-per-node starts CPU ranks but the cluster config says device: cuda; "
                              "use --gpus-per-node, or set device: cpu")
        return procs_per_node, "cpu"
    if device_setting == "cpu" or gpus == 0:
        if device_setting == "cuda":
            raise DistributedSetupError(f"{host} shows no GPU but the cluster config says device: cuda; "
                                        "give the pod its GPUs (e.g. resources.limits nvidia.com/gpu) "
                                        "or set device: cpu")
        if gpus_per_node is None:
            raise ConfigError(f"{host} shows no GPU: pass --procs-per-node N to run N CPU ranks per node")
        return gpus_per_node, "cpu"
    wanted = gpus_per_node or gpus
    if wanted > gpus:  # the '1 x 16 on 2 x 8' mistake, caught before CUDA's "invalid device ordinal"
        total = wanted * num_nodes
        raise DistributedSetupError(
            f"--gpus-per-node {wanted} but {host} shows {gpus} GPU(s): a node runs one rank per GPU "
            f"of its own; for {total} GPUs run {-(-total // gpus)} nodes (WORLD_SIZE = number of nodes) "
            f"with --gpus-per-node {gpus}"
        )
    return wanted, "cuda"


def nccl_environ(num_nodes: int, ranks_per_node: int, device: str, train: TrainConfig | None,
                 cluster: ClusterConfig) -> dict[str, str]:
    """The plan's NCCL settings for this node count (and the batch check when training)."""
    # Other tasks only need the NCCL part, which depends on the node count alone: plan a batch that
    # always splits, of clips so small that the memory check cannot refuse it.
    spec: TrainConfig | Mapping[str, Any] = train if train is not None else {
        "data": {"frames": 4, "height": 8, "width": 8},
        "batch": {"effective": num_nodes * ranks_per_node, "per_gpu": 1}}
    plan = plan_for(num_nodes, ranks_per_node, spec, gpu_memory_gb=cluster.gpu_memory_gb,
                    cpus_per_task=cluster.cpus_per_task, device=device)
    return dict(plan.nccl_env)


def supervise(node_rank: int, grace_s: float, commands: list[RankCommand]) -> int:
    """Run the node's ranks; the launcher's exit code (docs/errors.md, "Exit codes"): 0, 1 when a rank failed
    (its own code is in the line that names it), or 128 + the stop signal (143 SIGTERM, 130 SIGINT)."""
    outcome = Supervisor(grace_s, say=lambda line: say(f"[launch] node {node_rank}: {line}")).run(commands)
    labels = [c.label for c in commands]
    if outcome.failed is not None:
        say(f"error: node {node_rank}: {outcome.describe_failure(labels)}; "
            f"stopped the {outcome.stopped_others} other rank(s) of this node; "
            f"{labels[outcome.failed].split(' (')[0]}'s output above says why", err=True)
        return 1
    if outcome.stop_signal is not None:
        name = signal.Signals(outcome.stop_signal).name
        say(f"[launch] node {node_rank}: all ranks exited after {name}; "
            f"exiting {128 + outcome.stop_signal} so the "
            "platform restarts this node (the run resumes from its latest checkpoint)")
        return 128 + outcome.stop_signal
    return 0


def say(line: str, err: bool = False) -> None:
    """Write one whole line with one write: ranks share the node's stdout/stderr, and print() writes the
    newline separately when Python runs unbuffered (PYTHONUNBUFFERED), so lines of two ranks could merge."""
    stream = sys.stderr if err else sys.stdout
    stream.write(line + "\n")
    stream.flush()
