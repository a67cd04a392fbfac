"""Start training on a container platform (Kubernetes Job, KubeBrain, ...) or under torchrun.

    taehv launch --train configs/train/taehv.yaml                 # the platform's entrypoint, one per node
    taehv launch --procs-per-node 2 --train configs/train/tiny.yaml   # CPU-only nodes: 2 ranks each
    taehv launch --task smoke                                     # every rank: rendezvous + all-reduce
    torchrun --nproc-per-node 8 -m taehv_slurm launch --train configs/train/taehv.yaml  # torchrun starts them

A platform starts ONE process per node and sets WORLD_SIZE = number of nodes, RANK = node index and
MASTER_ADDR / MASTER_PORT = node 0's address. This launcher detects the node's GPUs, starts one rank per
GPU (global rank = node index x GPUs per node + local rank) with torchrun's variables, and watches them.
SIGTERM / SIGINT are passed on: the ranks save at the next step and exit, and the launcher exits 143
(130 for SIGINT) so the platform restarts the node and the run resumes from `latest`. A rank that dies
takes the node down at once with one line naming it (exit 1). configs/platform/k8s-job.yaml is a full
example.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from taehv_slurm.backends import PlatformBackend
from taehv_slurm.cli.conventions import DEFAULT_TRAIN, flag_origins, one_line_errors
from taehv_slurm.common.config import (
    ClusterConfig,
    ConfigError,
    TrainConfig,
    load_cluster,
    load_train,
    split_overrides,
)
from taehv_slurm.common.messages import command, first_line
from taehv_slurm.common.security import make_private_dir
from taehv_slurm.common.typed_yaml import parse_set_args
from taehv_slurm.runtime import collector
from taehv_slurm.runtime.bytecode import keep_bytecode
from taehv_slurm.runtime.distenv import LAUNCHER_MARK, DistEnv, DistributedSetupError
from taehv_slurm.runtime.node_launcher import (
    choose_ranks,
    for_node,
    nccl_environ,
    say,
    supervise,
    visible_gpus,
)
from taehv_slurm.runtime.supervisor import RankCommand
from taehv_slurm.runtime.tasks import TaskNotFoundError, TaskRef, resolve
from taehv_slurm.training import TRAIN_TASK

PLATFORM_CLUSTER = "configs/platform/cluster.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=command("launch"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--train", default=DEFAULT_TRAIN, help=f"training YAML (default {DEFAULT_TRAIN})")
    p.add_argument("--cluster", default=PLATFORM_CLUSTER,
                   help="runtime settings: device, timeouts, env, job_dir, requeue limits "
                        f"(default {PLATFORM_CLUSTER})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any cluster or train key, e.g. --set steps=1000 --set env.NCCL_DEBUG=INFO")
    p.add_argument("--gpus-per-node", type=int, help="GPUs to use per node (default: all that torch sees)")
    p.add_argument("--procs-per-node", type=int, help="CPU ranks per node (nodes without GPUs, tests)")
    p.add_argument("--task", default="train", metavar="train|smoke|MODULE:NAME",
                   help="what every rank runs (default train); MODULE:NAME is a callable taking a RunContext "
                        "(a class is instantiated without arguments)")
    p.add_argument("--run-dir", help="run folder on storage every node shares "
                                     "(default <job_dir>/<train name>); "
                                     "the same folder on a restart resumes from its latest checkpoint")
    p.add_argument("--bandwidth-mib", default="", metavar="SIZES",
                   help="smoke task: all-reduce bus bandwidth at these message sizes, e.g. 1,16,128")
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.task not in ("train", "smoke") and ":" not in args.task:
        raise ConfigError(f"--task {args.task!r}: expected train, smoke or MODULE:NAME")
    if "LOCAL_RANK" in os.environ:  # started by torchrun or by this launcher: this process is one rank
        return run_rank(args)
    return launch_node(args, argv)


def read_configs(args: argparse.Namespace) -> tuple[ClusterConfig, TrainConfig]:
    """The cluster and train configs with --set applied (the cluster not yet shaped for this node)."""
    cluster_over, train_over = split_overrides(parse_set_args(args.set))
    if "nodes" in cluster_over:
        raise ConfigError("--set nodes: on a platform the number of nodes is WORLD_SIZE; remove --set nodes")
    origins = flag_origins(args)
    return (load_cluster(args.cluster, origins=origins, **cluster_over),
            load_train(args.train, origins=origins, **train_over))


def run_dir_of(args: argparse.Namespace, cluster: ClusterConfig, train: TrainConfig) -> Path:
    # Stable across restarts (no timestamp): a restarted pod must find the same checkpoints.
    if args.run_dir:
        return Path(args.run_dir)
    return Path(cluster.job_dir) / (train.name if args.task == "train" else args.task.replace(":", "-"))


def launch_node(args: argparse.Namespace, argv: list[str]) -> int:
    node = DistEnv.from_environ()
    if node.source in ("slurm", "local"):
        raise DistributedSetupError(
            f"{command('launch')} found {node.source} task variables: under Slurm submit with "
            f"`{command('submit')}` "
            f"(one task per GPU); {command('launch')} is for platforms that start one process per node")
    if ":" in args.task and importlib.util.find_spec(args.task.partition(":")[0]) is None:
        # this node's error, not one per rank
        raise ConfigError(f"--task {args.task}: no module {args.task.partition(':')[0]!r} on PYTHONPATH; "
                          "give MODULE:NAME of a callable taking a RunContext")
    base, train = read_configs(args)
    ranks, device = choose_ranks(args.gpus_per_node, args.procs_per_node, base.device, visible_gpus(),
                                 node.num_nodes)
    cluster = for_node(base, ranks, device, args.cluster)
    extra = nccl_environ(node.num_nodes, ranks, device, train if args.task == "train" else None, cluster)
    run_dir = make_private_dir(run_dir_of(args, cluster, train).absolute(), cluster.group)
    # Precedence: the plan's NCCL defaults < the platform's environment < the cluster config's env.
    environ = {**extra, **os.environ, **cluster.env, "PYTHONUNBUFFERED": "1"}
    environ.setdefault("OMP_NUM_THREADS", str(cluster.runtime().torch_threads))
    # The ranks re-read the same flags; the device and run folder chosen here are appended (last wins).
    rank_argv = [sys.executable, "-m", "taehv_slurm.cli.launch", *argv, "--set", f"device={device}",
                 "--run-dir", str(run_dir)]
    ranks_env = [node.for_local_rank(i, ranks) for i in range(ranks)]
    say(f"[launch] node {node.node_rank}/{node.num_nodes} on {socket.gethostname()}: "
        f"ranks {ranks_env[0].rank}-{ranks_env[-1].rank} of {ranks_env[0].world_size} ({ranks} per node, "
        f"{device}), master {node.master_addr}:{node.master_port}, run folder {run_dir}")
    marked = {LAUNCHER_MARK: "1"}  # the ranks read their rank from us, not from an enclosing Slurm step
    return supervise(node.node_rank, float(cluster.kill_wait_s),
                     [RankCommand(rank_argv, {**environ, **env.torchrun_environ(), **marked},
                                  label=f"rank {env.rank} (local rank {env.local_rank})")
                      for env in ranks_env])


def run_rank(args: argparse.Namespace) -> int:
    """Run the task in this process (one rank): started by this launcher or by torchrun."""
    from taehv_slurm.runtime.requeue import StopRequested, TaskFailedError
    from taehv_slurm.submission import requeueable_task

    collector.pause()  # until the task's start is over (taehv_slurm.runtime.collector)
    env = DistEnv.from_environ()
    base, train = read_configs(args)
    cluster = for_node(base, env.local_world_size, "auto", args.cluster)
    run_dir = make_private_dir(run_dir_of(args, cluster, train), cluster.group)
    keep_bytecode(cluster.runtime().compile_cache_dir)  # before the task imports torch
    if args.task == "smoke":
        from taehv_slurm.runtime.smoke import SmokeTask

        sizes = tuple(int(s) for s in args.bandwidth_mib.split(",") if s.strip())
        backend = "gloo" if cluster.device == "cpu" else cluster.dist_backend
        facts = SmokeTask(backend=backend, rendezvous_timeout_s=cluster.rendezvous_timeout_s,
                          bandwidth_mib=sizes)()
        say(f"[taehv] smoke: {json.dumps(facts, default=str)}")
        return 0 if facts["sum"] == facts["expected_sum"] else 1
    # No requeue on failure: on a platform the platform restarts the node, so a failed rank must exit
    # non-zero (the launcher then stops the node) rather than requeue itself and exit 0 as on Slurm.
    wrapped = requeueable_task(make_task(args.task, cluster, train), run_dir, cluster, PlatformBackend(),
                               requeue_on_failure=False)
    try:
        result = wrapped()
    except StopRequested as err:
        say(f"error: rank {env.rank}: not starting: {err}", err=True)
        return 3
    except TaskFailedError as err:  # its traceback is already in this rank's output; the message is one line
        say(f"error: rank {env.rank}: {err}", err=True)
        return 1
    except Exception as err:
        say(f"error: rank {env.rank}: {type(err).__name__}: {first_line(err)}", err=True)
        return 1
    if env.rank == 0 and result is not None:
        say(f"[taehv] result: {json.dumps(result, default=str)}")
    return 0


def make_task(spec: str, cluster: ClusterConfig, train: TrainConfig) -> Callable[..., Any]:
    if spec == "train":
        return TaskRef(TRAIN_TASK, train=train.to_dict(), runtime=cluster.runtime())
    try:
        obj = resolve(spec)
    except TaskNotFoundError as err:
        raise ConfigError(f"--task {spec}: {err}; give MODULE:NAME of a callable on PYTHONPATH") from None
    return obj() if isinstance(obj, type) else obj


if __name__ == "__main__":
    sys.exit(main())
