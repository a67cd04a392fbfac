"""Who am I in the job: one `DistEnv` read from Slurm, torchrun, a container platform, or nothing.

`DistEnv.from_environ()` is the only place that reads the launcher's variables; `init_distributed()`
turns it into a process group. The per-node GPU count is always separate from the world size, so
"2 nodes × 8 GPUs launched as 1 node × 16 processes" fails here with one line — before CUDA's
"invalid device ordinal".
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from taehv_slurm.common.messages import first_line
from taehv_slurm.runtime import network

# MASTER_PORT = PORT_BASE + job_id % PORT_SPAN. The range sits below Linux's ephemeral ports
# (32768–60999), so an outgoing connection never holds it; two jobs on one node share a port only if
# their ids differ by a multiple of PORT_SPAN (12768 consecutive submissions) and they run together.
PORT_BASE = 20000
PORT_SPAN = 12768

# Set (to "1") by taehv launch in the environment of the ranks it starts, like torchrun's TORCHELASTIC_RUN_ID.
LAUNCHER_MARK = "TAEHV_LAUNCHER"
# Launcher variables a submitted job must not inherit from the submitting process (sbatch exports it).
INHERITED_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                           "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                           LAUNCHER_MARK, "TAEHV_JOB_ID", "TAEHV_RESTART_COUNT", "TAEHV_LAUNCH",
                           "TAEHV_STEP_LOOP", "TAEHV_SLURM_RELAY", "TAEHV_JOB_ENDING")

Source = Literal["slurm", "torchrun", "platform", "local", "single"]


class DistributedSetupError(RuntimeError):
    """The launch does not match the machine; the message is one line naming the fix."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str
    source: Source
    restart_count: int = 0  # how many times Slurm restarted this job (requeues)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read the launcher's variables. Order: torchrun or our platform launcher (they mark their
        children), Slurm task, submitit's local executor, other torchrun-style launchers, container
        platform (node-level RANK/WORLD_SIZE), single process.

        A Slurm or local task outranks bare RANK/LOCAL_RANK/WORLD_SIZE: those may be left over from the
        process that submitted the job (a notebook under torchrun), and sbatch exports its environment.
        """
        env = dict(os.environ if environ is None else environ)
        torchrun_vars = "LOCAL_RANK" in env and "RANK" in env and "WORLD_SIZE" in env
        if torchrun_vars and ("TORCHELASTIC_RUN_ID" in env or env.get(LAUNCHER_MARK) == "1"):
            return cls._from_torchrun(env)
        if "SLURM_PROCID" in env and "SLURM_JOB_ID" in env and "SLURM_LOCALID" in env:
            return cls._from_slurm(env)
        if "SUBMITIT_LOCAL_GLOBALID" in env:
            return cls._from_submitit_local(env)
        if torchrun_vars:
            return cls._from_torchrun(env)
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls._from_platform(env)
        job_id = str(os.getpid())
        return cls(0, 0, 1, 1, 0, 1, "127.0.0.1", port_for_job(job_id), job_id, "single")

    @classmethod
    def _from_torchrun(cls, env: dict[str, str]) -> DistEnv:
        world = _int(env, "WORLD_SIZE")
        local_world = _int(env, "LOCAL_WORLD_SIZE", default=None) or world
        rank = _int(env, "RANK")
        job_id = (env.get("TORCHELASTIC_RUN_ID") or env.get("TAEHV_JOB_ID") or env.get("SLURM_JOB_ID")
                  or "torchrun")
        return cls(
            rank=rank,
            local_rank=_int(env, "LOCAL_RANK"),
            world_size=world,
            local_world_size=local_world,
            node_rank=_first_int(env, "GROUP_RANK", "NODE_RANK", default=rank // local_world),
            num_nodes=max(1, world // local_world),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", default=None) or port_for_job(job_id),
            job_id=job_id,
            source="torchrun",
            restart_count=_first_int(env, "TAEHV_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", default=0),
        )

    @classmethod
    def _from_slurm(cls, env: dict[str, str]) -> DistEnv:
        job_id = slurm_job_id(env)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
        hosts = expand_nodelist(nodelist)
        num_nodes = _first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", default=len(hosts))
        world = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=None)
        return cls(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID"),
            world_size=world,
            local_world_size=_tasks_on_this_node(env, world, num_nodes),
            node_rank=_int(env, "SLURM_NODEID"),
            num_nodes=num_nodes,
            master_addr=env.get("TAEHV_MASTER_ADDR") or hosts[0],
            master_port=_int(env, "TAEHV_MASTER_PORT", default=None) or port_for_job(job_id),
            job_id=job_id,
            source="slurm",
            restart_count=_int(env, "SLURM_RESTART_COUNT", default=0),
        )

    @classmethod
    def _from_submitit_local(cls, env: dict[str, str]) -> DistEnv:
        world = _int(env, "SUBMITIT_LOCAL_NTASKS")
        job_id = env.get("SUBMITIT_LOCAL_JOB_ID", str(os.getpid()))
        return cls(
            rank=_int(env, "SUBMITIT_LOCAL_GLOBALID"),
            local_rank=_int(env, "SUBMITIT_LOCAL_LOCALID"),
            world_size=world,
            local_world_size=world,
            node_rank=0,
            num_nodes=1,
            master_addr="127.0.0.1",
            master_port=port_for_job(job_id),
            job_id=job_id,
            source="local",
            restart_count=_int(env, "TAEHV_RESTART_COUNT", default=0),
        )

    @classmethod
    def _from_platform(cls, env: dict[str, str]) -> DistEnv:
        # Container platforms (K8s Job, KubeBrain) start one process per NODE: RANK is the node index
        # and WORLD_SIZE the number of nodes. As a process env that is one rank per node;
        # `taehv launch` expands it into one rank per GPU with `for_local_rank`.
        node, nodes = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if "MASTER_ADDR" not in env and nodes > 1:
            raise DistributedSetupError(
                f"RANK={node} WORLD_SIZE={nodes} are set but MASTER_ADDR is not: the platform must set "
                "MASTER_ADDR (and MASTER_PORT) to node 0's address"
            )
        job_id = env.get("TAEHV_JOB_ID") or env.get("JOB_ID") or env.get("MASTER_ADDR", "platform")
        return cls(
            rank=node,
            local_rank=0,
            world_size=nodes,
            local_world_size=1,
            node_rank=node,
            num_nodes=nodes,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", default=None) or port_for_job(job_id),
            job_id=job_id,
            source="platform",
        )

    def for_local_rank(self, local_rank: int, local_world_size: int) -> DistEnv:
        """The env of one GPU rank on this node when a node-level process starts `local_world_size` ranks."""
        if not 0 <= local_rank < local_world_size:
            raise ValueError(f"local_rank {local_rank} outside 0..{local_world_size - 1}")
        return dataclasses.replace(
            self,
            rank=self.node_rank * local_world_size + local_rank,
            local_rank=local_rank,
            world_size=self.num_nodes * local_world_size,
            local_world_size=local_world_size,
        )

    def torchrun_environ(self) -> dict[str, str]:
        """The variables torch and DeepSpeed read (env:// init), for a child process or this one."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TAEHV_JOB_ID": self.job_id,
            "TAEHV_RESTART_COUNT": str(self.restart_count),
        }

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.num_nodes}) via {self.source}, "
            f"master {self.master_addr}:{self.master_port}"
        )


def attempt_of_environ(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(job id, restart count) of the job attempt this process belongs to — also outside its ranks (the
    sbatch script's own steps, the local controller), where `DistEnv.from_environ` has no rank to read."""
    env = os.environ if environ is None else environ
    job_id = slurm_job_id(env) or env.get("SUBMITIT_LOCAL_JOB_ID") or env.get("TAEHV_JOB_ID") or ""
    restart = env.get("SLURM_RESTART_COUNT") or env.get("TAEHV_RESTART_COUNT") or "0"
    return job_id, int(restart)


def slurm_job_id(env: Mapping[str, str]) -> str:
    """The id Slurm knows this job by, '' outside Slurm: an array task's is ARRAYJOB_TASK (its SLURM_JOB_ID
    is a number of its own that squeue, sacct and submitit do not show), so every Slurm call about the task
    — requeue, hold, release, ExcNodeList — and every record of it names the task itself."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else env.get("SLURM_JOB_ID", "")


def port_for_job(job_id: str) -> int:
    """A rendezvous port in [PORT_BASE, PORT_BASE + PORT_SPAN) derived from the job id."""
    digits = re.sub(r"\D", "", job_id)
    number = int(digits) if digits else sum(map(ord, job_id))
    return PORT_BASE + number % PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """`gpu[001-003,007],cpu01` → ['gpu001', 'gpu002', 'gpu003', 'gpu007', 'cpu01'] (python-hostlist)."""
    import hostlist  # python-hostlist: the parser Slurm sites use; small and imported only here

    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as err:
        raise DistributedSetupError(f"cannot parse the Slurm node list {nodelist!r}: {err}") from None
    if not hosts:
        raise DistributedSetupError(f"empty Slurm node list {nodelist!r}")
    return hosts


def _tasks_on_this_node(env: dict[str, str], world: int, num_nodes: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "8(x2)" or "8,7"; the node's own count is what matters.
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts: list[int] = []
        for part in per_node.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if m:
                counts += [int(m.group(1))] * int(m.group(2) or 1)
        node = _int(env, "SLURM_NODEID", default=0) or 0
        if node < len(counts):
            return counts[node]
    return max(1, world // max(1, num_nodes))


def _first_int(env: Mapping[str, str], *names: str, default: int | None) -> int:
    for name in names:
        if env.get(name):
            return _int(env, name)
    if default is None:
        raise DistributedSetupError(f"environment variable {names[0]} is missing; the launcher must set it")
    return default


def _int(env: Mapping[str, str], name: str, default: int | None | str = "required") -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default == "required":
            raise DistributedSetupError(f"environment variable {name} is missing; the launcher must set it")
        return default  # type: ignore[return-value]
    try:
        return int(raw)
    except ValueError:
        raise DistributedSetupError(f"environment variable {name}={raw!r} is not an integer") from None


# ----------------------------------------------------------------------------------- process group


def init_distributed(env: DistEnv, backend: str | None = None, timeout_s: float | None = None,
                     rendezvous_timeout_s: float = 300.0, use_cuda: bool | None = None) -> str:
    """Create the default process group for `env` and return the backend used.

    backend: "nccl", "gloo" or None/"auto" (nccl when CUDA is usable, else gloo).
    timeout_s: collective timeout (the plan's NCCL timeout); rendezvous_timeout_s bounds how long a
    rank waits for MASTER_ADDR, so an unreachable master fails with a message instead of hanging.
    """
    import datetime

    import torch
    import torch.distributed as dist

    if not 0 <= env.rank < env.world_size or not 0 <= env.local_rank < env.local_world_size:
        raise DistributedSetupError(
            f"rank {env.rank} (local {env.local_rank}) is outside world size {env.world_size} "
            f"(local {env.local_world_size}): the launcher's RANK/WORLD_SIZE variables disagree; "
            "check how ranks are started"
        )
    os.environ.update(env.torchrun_environ())  # DeepSpeed and other libraries read these
    if use_cuda is None:
        use_cuda = backend == "nccl" or (backend in (None, "auto") and torch.cuda.is_available())
    if use_cuda:
        check_device_ordinal(env, torch.cuda.device_count())
        torch.cuda.set_device(env.local_rank)
    if backend in (None, "auto"):
        backend = "nccl" if use_cuda else "gloo"
    if dist.is_initialized():
        return backend
    store = rendezvous_store(env, rendezvous_timeout_s)
    kwargs = {}
    if use_cuda and backend == "nccl" and env.world_size > 1:
        network.nccl_debug_file()  # what NCCL chooses between nodes, for network.transport
        # Connect NCCL now, so a rank that cannot fails here rather than at its first step. Not for one rank:
        # it runs none of our collectives (each is skipped at world size 1; DeepSpeed's connect on first use),
        # and connecting its communicator would only lengthen every start (by about a second in a profile
        # of a warm start on an H200).
        kwargs["device_id"] = torch.device("cuda", env.local_rank)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s or 1800),
        **kwargs,
    )
    return backend


def rendezvous_store(env: DistEnv, timeout_s: float) -> Any:
    """The store the ranks meet at: node 0's TCPStore (waiting ≤ `timeout_s` for every rank), or an
    in-process one for a single rank. An unreachable master is one line, not a hang."""
    import datetime

    import torch.distributed as dist

    if env.world_size == 1:
        return dist.HashStore()
    try:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=True,
        )
    except (RuntimeError, OSError) as err:  # DistStoreError/DistNetworkError subclass RuntimeError
        raise DistributedSetupError(
            f"rank {env.rank}: rendezvous with {env.master_addr}:{env.master_port} failed after "
            f"≤{timeout_s:.0f} s ({first_line(err)}); "
            "check that MASTER_ADDR is node 0's reachable "
            "address and the port is open, or raise rendezvous_timeout_s"
        ) from None


def check_device_ordinal(env: DistEnv, device_count: int) -> None:
    """Fail with one line when this rank's local_rank has no GPU (the '1 × 16 on 2 × 8' mistake)."""
    if env.local_rank < device_count:
        return
    host = socket.gethostname()
    raise DistributedSetupError(
        f"rank {env.rank} has local_rank {env.local_rank} but {host} shows {device_count} GPU(s): "
        f"this launch puts {env.local_world_size} tasks on each of {env.num_nodes} node(s) "
        f"(world size {env.world_size}); a node runs one task per GPU, so use nodes = "
        f"{max(1, -(-env.world_size // max(device_count, 1)))} with tasks_per_node = gpus_per_node = "
        f"{device_count} in the cluster config (e.g. --nodes 2 for 16 GPUs on 8-GPU nodes)"
    )


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
