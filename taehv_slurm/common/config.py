"""Typed configuration: cluster YAML → `ClusterConfig`, training YAML → `TrainConfig`, and loading both.

The cluster schema and its validation live here, the training schema in taehv_slurm.common.train_config (its
names are importable from here too); reading them (YAML or a dict, `--set key=value` overrides, every
problem as one `ConfigError` line naming the file or flag and the fix) is taehv_slurm.common.typed_yaml's.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from taehv_slurm.common.machine import gpu_memory_here, gpus_here
from taehv_slurm.common.train_config import (  # noqa: F401  (re-exported: the schema's names, from one module)
    TEACHER_KINDS,
    VIDEO_EXTENSIONS,
    BatchConfig,
    DataConfig,
    DivergenceConfig,
    EngineConfig,
    IntervalConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    TeacherConfig,
    TeacherKind,
    TrackingConfig,
    TrainConfig,
    missing_engine_package,
    missing_tracker_package,
)
from taehv_slurm.common.typed_yaml import ConfigError, check, load_typed

# sbatch --signal: "the signal may be sent up to 60 seconds earlier than specified" (slurmctld checks
# time limits periodically).
SLURM_SIGNAL_EARLY_S = 60
# The time-limit warning must leave time to reach a step boundary (two on GPUs: the stop flag is read one
# step late), save (~1 s for TAEHV, docs/benchmarks.md) and requeue: below this the run would lose work.
SIGNAL_DELAY_MIN_S = 30

# Env names treated as secrets even when not listed in secret_env: *TOKEN*, *SECRET*, *PASSWORD*, *_PASS,
# *APIKEY*, *API_KEY*, *ACCESS_KEY*, *PRIVATE_KEY*, *CREDENTIAL*, and names ending in KEY (WANDB_KEY).
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|(^|_)PASS$|API_?KEY|ACCESS_KEY|PRIVATE_KEY"
                          r"|CREDENTIAL|(^|_)KEY$)", re.I)

# Backends whose jobs run on the submitting machine (one node); the others are cluster schedulers.
MACHINE_BACKENDS = frozenset({"local", "debug"})


# ----------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class RuntimeSettings:
    """What a task needs from the cluster config at run time (plain values, pickled into the job)."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    rendezvous_timeout_s: int = 300
    collective_timeout_s: int | None = None  # None: the plan's NCCL timeout for the node count
    torch_threads: int = 1
    gpu_memory_gb: float = 80.0
    cpus_per_task: int = 8
    run_dir: str | None = None  # where a task called directly (no scheduler) writes; None: runs/<train name>
    slow_rank_margin: float | None = None  # ClusterConfig's; None: by device (stragglers.DEFAULT_MARGIN)
    slow_rank_windows: int = 3  # late in this many log windows in a row: named (0: no step timed)
    compile_cache_dir: str | None = None  # torch.compile's caches, shared by every attempt, shard and rank

    @classmethod
    def of(cls, value: RuntimeSettings | Mapping[str, Any] | None) -> RuntimeSettings:
        """Settings as given, or built from a mapping of the same fields (e.g. read from JSON)."""
        return value if isinstance(value, RuntimeSettings) else cls(**dict(value or {}))


@dataclass
class ClusterConfig:
    """Where and how a job runs. Each field reaches the sbatch script or the job's environment."""

    name: str = "taehv"  # Slurm job name
    backend: Literal["slurm", "local", "debug"] = "slurm"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    nodes: int = 1
    gpus_per_node: int = 8
    # One task per GPU. None means "= gpus_per_node" (or 1 on CPU-only nodes).
    tasks_per_node: int | None = None
    # Set true only to run a different number of tasks than GPUs per node on purpose.
    allow_task_gpu_mismatch: bool = False
    gres: str | None = None  # default "gpu:<gpus_per_node>"; e.g. "gpu:h100:8" for typed GRES
    cpus_per_task: int = 8
    mem_gb: float | None = None  # per node; None = the partition's default
    time_min: int = 240
    exclusive: bool = False
    # Seconds before the time limit at which Slurm sends USR2: the job saves and requeues itself.
    signal_delay_s: int = 120
    kill_wait_s: int = 30  # the cluster's KillWait: seconds from SIGTERM to SIGKILL; a save must fit in it
    max_requeues: int = 20  # every requeue counts: timeout, preemption, failure
    max_requeues_without_progress: int = 2  # consecutive restarts that end at the step they began
    requeue_on_failure: bool = True  # a crashed rank requeues the job (within the limits above)
    exclude_failed_nodes: bool = True  # a node whose rank was killed or hung is left out of the next attempts
    # After a rank failed, hung or was killed, the job starts its ranks again inside its allocation (on the
    # healthy nodes, a spare in a failed node's place) instead of going back to the queue; false: requeue.
    restart_in_allocation: bool = True
    spare_nodes: int = 0  # nodes asked beyond `nodes`: each can take a failed node's place
    # The fewest nodes a run may go on with, at the same effective batch, when a node fails and no spare is
    # left (None: `nodes`, never fewer); a requeue returns it to `nodes`.
    min_nodes: int | None = None
    # Every rank's watchdog (docs/failures.md): a section (step, data, validation, save) that runs longer
    # than max(hang_floor_s, hang_factor x the slowest time seen in it) is a hang; hang_uncalibrated_s
    # until it has seen enough of the section. heartbeat_s: how often each rank records its progress.
    hang_detection: bool = True  # false: no watchdog thread at all
    heartbeat_s: float = 5.0
    hang_floor_s: float = 60.0
    hang_factor: float = 5.0
    hang_uncalibrated_s: float = 1800.0
    # The rank the others wait for (report only, docs/failures.md); margin None: 0.1 on GPUs, 0.5 on CPUs.
    slow_rank_margin: float | None = None  # late: the others wait > this × their time to reach the collective
    slow_rank_windows: int = 3  # late this many log windows in a row: named; 0: off (no step is timed)
    setup: list[str] = field(default_factory=list)  # shell lines run before srun
    env: dict[str, str] = field(default_factory=dict)  # exported in the job
    secret_env: list[str] = field(default_factory=list)  # env names never written anywhere
    srun_args: list[str] = field(default_factory=lambda: ["--kill-on-bad-exit=1"])
    sbatch_args: dict[str, str] = field(default_factory=dict)  # extra #SBATCH flags, e.g. mail-type
    # a sweep's runs at once on Slurm (sbatch --array=0-N%4); the rest wait in the queue
    array_parallelism: int = 4
    job_dir: str = "runs"  # run folders and the job registry; must be on a filesystem all nodes share
    python: str | None = None  # command that starts python on the nodes; default: this interpreter
    # The ranks in a container image (docs/configuration.md): pyxis (srun --container-image), apptainer or
    # charliecloud. The batch script's own steps and every Slurm command run outside, with `python`.
    container_image: str | None = None
    container_runtime: Literal["pyxis", "apptainer", "charliecloud"] = "pyxis"
    container_mounts: list[str] = field(default_factory=list)  # SRC:DST[:FLAGS]; the run folders among them
    container_python: str = "python3"  # the image's interpreter, which starts the ranks
    # After a preemption or the time limit: `self` = the job requeues itself (scontrol requeue); `follow_up`
    # = it submits its next attempt as a new job (sbatch --dependency=afternotok); `auto` = self, and
    # follow_up where the cluster does not requeue jobs or refuses the requeue.
    requeue: Literal["auto", "self", "follow_up"] = "auto"
    # The job imports a copy of the checkout's tracked files made at submit (<job_dir>/code/), not the
    # checkout itself, which may change while the job waits or between its attempts.
    code_snapshot: bool = True
    device: Literal["auto", "cuda", "cpu"] = "auto"  # auto: cuda where the nodes have GPUs
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    rendezvous_timeout_s: int = 300  # bounded wait for all ranks to meet at MASTER_ADDR
    collective_timeout_s: int | None = None  # None: the plan's NCCL timeout for this node count
    torch_threads: int | None = None  # torch.set_num_threads per rank; None: cpus_per_task
    gpu_memory_gb: float = 80.0  # per GPU; the plan checks that the engine fits
    group: str | None = None  # share run folders with this Unix group (read-only); None: owner only
    # Submit reads a sample of the data with the job's own readers (within data_check_budget_s) before
    # the job waits in the queue; false where the login node cannot see the data (the job still checks
    # at start-up).
    check_data_on_submit: bool = True
    data_check_budget_s: float = 10.0
    # torch.compile's caches (default <job_dir>/compile-cache, private like the runs): every attempt,
    # shard and rank loads what the first compiled. The folder holds code the jobs run: keep it yours.
    compile_cache_dir: str | None = None

    # A cluster YAML file must name these (an empty file is a mistake, not the defaults).
    REQUIRED_KEYS: ClassVar[tuple[str, ...]] = ("job_dir",)  # where everything goes: never a default

    def __post_init__(self) -> None:
        if self.tasks_per_node is None:
            self.tasks_per_node = self.gpus_per_node if self.gpus_per_node > 0 else 1

    @property
    def world_size(self) -> int:
        return self.nodes * int(self.tasks_per_node or 1)

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes the run goes on with after a node fails (`min_nodes`, else `nodes`)."""
        return self.min_nodes or self.nodes

    @property
    def gres_request(self) -> str | None:
        if self.gres is not None:
            return self.gres or None
        return f"gpu:{self.gpus_per_node}" if self.gpus_per_node > 0 else None

    def task_device(self) -> str:
        """Where the job's tasks compute: `device`, or for `auto` cuda when each node has GPUs — on the
        local and debug backends, when THIS machine has them."""
        if self.device != "auto":
            return self.device
        if self.backend in MACHINE_BACKENDS and not gpus_here():
            return "cpu"
        return "cuda" if self.gpus_per_node > 0 else "cpu"

    def gpu_memory(self) -> tuple[float, str]:
        """(GB per GPU, source): this machine's GPU where the jobs run here, else gpu_memory_gb as stated."""
        here = gpu_memory_here() if self.backend in MACHINE_BACKENDS else None
        return (here, "this machine's GPU") if here else (self.gpu_memory_gb, "gpu_memory_gb")

    def runtime(self, device: str | None = None) -> RuntimeSettings:
        """What a task needs from the cluster config where it runs (device: override `device`)."""
        compile_cache = Path(self.compile_cache_dir or f"{self.job_dir}/compile-cache").absolute()
        return RuntimeSettings(device=device or self.device, dist_backend=self.dist_backend,
                               rendezvous_timeout_s=self.rendezvous_timeout_s,
                               collective_timeout_s=self.collective_timeout_s,
                               torch_threads=self.torch_threads or self.cpus_per_task,
                               gpu_memory_gb=self.gpu_memory()[0],
                               cpus_per_task=self.cpus_per_task, slow_rank_margin=self.slow_rank_margin,
                               slow_rank_windows=self.slow_rank_windows,
                               compile_cache_dir=str(compile_cache))

    def secret_names(self) -> set[str]:
        """Env names whose values must never be written: listed in secret_env or named like a secret."""
        return set(self.secret_env) | {k for k in self.env if _SECRET_NAME.search(k)}

    def public_env(self) -> dict[str, str]:
        secret = self.secret_names()
        return {k: v for k, v in self.env.items() if k not in secret}

    def masked(self) -> dict[str, Any]:
        """The config as a dict with secret values replaced by '***' (for previews, registries, logs)."""
        data = dataclasses.asdict(self)
        secret = self.secret_names()
        data["env"] = {k: ("***" if k in secret else v) for k, v in self.env.items()}
        return data

    def without_secrets(self) -> ClusterConfig:
        """A copy safe to pickle into the job folder: secret env values travel another way."""
        return dataclasses.replace(self, env=self.public_env())

    def validate(self, source: str = "cluster config") -> ClusterConfig:
        check(self.nodes >= 1, source, f"nodes must be ≥ 1, got {self.nodes} (set nodes: 1 or more)")
        check(self.gpus_per_node >= 0, source, f"gpus_per_node must be ≥ 0, got {self.gpus_per_node}")
        tasks = int(self.tasks_per_node or 0)
        check(tasks >= 1, source, f"tasks_per_node must be ≥ 1, got {tasks}")
        if self.gpus_per_node > 0 and tasks != self.gpus_per_node and not self.allow_task_gpu_mismatch:
            raise ConfigError(
                f"{source}: tasks_per_node={tasks} but gpus_per_node={self.gpus_per_node}: "
                f"run one task per GPU (remove tasks_per_node or set it to {self.gpus_per_node}); "
                "set allow_task_gpu_mismatch: true only if you mean it"
            )
        check(self.cpus_per_task >= 1, source, f"cpus_per_task must be ≥ 1, got {self.cpus_per_task}")
        check(self.time_min >= 1, source, f"time_min must be ≥ 1, got {self.time_min}")
        check(self.array_parallelism >= 1, source,
               f"array_parallelism must be ≥ 1, got {self.array_parallelism} "
               "(how many runs of a sweep may run at once)")
        check(self.signal_delay_s >= SIGNAL_DELAY_MIN_S, source,
               f"signal_delay_s={self.signal_delay_s} is below the minimum of {SIGNAL_DELAY_MIN_S} s: "
               "the time-limit warning (USR2) must leave time to reach a step boundary, save and requeue; "
               "set signal_delay_s: "
               f"{SIGNAL_DELAY_MIN_S} or more (README: what a site must configure)")
        check(
            self.signal_delay_s + SLURM_SIGNAL_EARLY_S < self.time_min * 60,
            source,
            f"time_min={self.time_min} leaves no time to train with signal_delay_s={self.signal_delay_s}: "
            f"Slurm sends the time-limit warning up to {SLURM_SIGNAL_EARLY_S} s before that, so it could "
            "come as the job starts, every time; raise time_min above "
            f"{(self.signal_delay_s + SLURM_SIGNAL_EARLY_S) // 60} or lower signal_delay_s",
        )
        check(self.max_requeues >= 0, source, f"max_requeues must be ≥ 0, got {self.max_requeues}")
        check(self.spare_nodes >= 0, source, f"spare_nodes must be ≥ 0, got {self.spare_nodes}")
        check(self.min_nodes is None or 1 <= self.min_nodes <= self.nodes, source,
              f"min_nodes must be between 1 and nodes ({self.nodes}), got {self.min_nodes}")
        check(self.rendezvous_timeout_s >= 1, source, "rendezvous_timeout_s must be ≥ 1")
        check(0.5 <= self.heartbeat_s <= self.hang_floor_s / 3, source,
               f"heartbeat_s={self.heartbeat_s} must be at least 0.5 and at most hang_floor_s / 3 "
               f"({self.hang_floor_s / 3:g}): a hang is told by records older than three heartbeats")
        margin = self.slow_rank_margin
        check(self.hang_factor >= 1 and self.hang_uncalibrated_s >= self.hang_floor_s
              and (margin is None or margin > 0) and self.slow_rank_windows >= 0, source,
               "hang_factor must be ≥ 1, hang_uncalibrated_s ≥ hang_floor_s, slow_rank_margin > 0 and "
               "slow_rank_windows ≥ 0 (0: off)")
        check(self.mem_gb is None or self.mem_gb > 0, source, f"mem_gb must be > 0, got {self.mem_gb}")
        if self.backend in MACHINE_BACKENDS and (self.nodes > 1 or self.spare_nodes):
            raise ConfigError(
                f"{source}: backend '{self.backend}' runs on this machine only, but nodes={self.nodes}"
                f"{f' and spare_nodes={self.spare_nodes}' if self.spare_nodes else ''}; set nodes: 1, "
                "spare_nodes: 0, or backend: slurm"
            )
        for name in self.env:
            check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None, source,
                   f"env name {name!r} is not a valid variable name")
        self._validate_container(source)
        return self

    def _validate_container(self, source: str) -> None:
        if not self.container_image:
            check(not self.container_mounts, source,
                  "container_mounts is set but container_image is not: name the image the ranks run in")
            return
        check(self.backend not in MACHINE_BACKENDS, source,
              f"container_image applies to Slurm jobs; backend '{self.backend}' runs the ranks on this "
              "machine as they are (remove container_image, or use backend: slurm)")
        for mount in self.container_mounts:
            parts = mount.split(":")
            check(2 <= len(parts) <= 3 and all(p.startswith("/") for p in parts[:2]), source,
                  f"container_mounts entry {mount!r} must be SRC:DST or SRC:DST:FLAGS with absolute paths "
                  "(e.g. /shared/runs:/shared/runs)")
            check(len(parts) == 2 or self.container_runtime != "charliecloud", source,
                  f"container_mounts entry {mount!r}: Charliecloud's binds take no flags (write SRC:DST)")


# ------------------------------------------------------------------------------------------ loading


def load_cluster(path_or_dict: str | os.PathLike | Mapping[str, Any] | None = None, *,
                 origins: Mapping[str, str] | None = None, **overrides: Any) -> ClusterConfig:
    """Load a cluster config from YAML (or a dict), apply overrides (dotted keys allowed), validate.

    An error names where the bad value came from: the file, or the override that made a valid config
    invalid — as `origins[key]` says it was given (e.g. '--nodes 0'), else 'override key=value'.
    """
    return load_typed(ClusterConfig, path_or_dict, "cluster config", overrides, origins, shipped_config)


def load_train(path_or_dict: str | os.PathLike | Mapping[str, Any] | None = None, *,
               origins: Mapping[str, str] | None = None, **overrides: Any) -> TrainConfig:
    """Load a training config from YAML (or a dict), apply overrides (dotted keys allowed), validate;
    errors as `load_cluster` names them."""
    return load_typed(TrainConfig, path_or_dict, "train config", overrides, origins, shipped_config)


def split_overrides(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Route `--set` overrides to the cluster or the train config by their first key."""
    cluster_keys = {f.name for f in dataclasses.fields(ClusterConfig)}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    cluster, train = {}, {}
    for key, value in overrides.items():
        head = key.split(".", 1)[0]
        if head in cluster_keys:
            cluster[key] = value
        elif head in train_keys:
            train[key] = value
        else:
            close = difflib.get_close_matches(head, list(cluster_keys | train_keys), n=1, cutoff=0.6)
            hint = (f" (did you mean '{close[0]}'?)" if close
                    else " (keys: see the cluster and train configs in configs/)")
            raise ConfigError(f"--set {key}={value}: unknown key '{head}'{hint}")
    return cluster, train


def shipped_config(path: str | os.PathLike) -> Path | None:
    """`configs/...` as shipped with the package (package data of taehv_slurm.configs, or the checkout's
    configs/ folder), for a relative path that does not exist from here; None when there is no such file."""
    parts = Path(path).parts
    if Path(path).is_absolute() or len(parts) < 2 or parts[0] != "configs":
        return None
    try:
        root = Path(str(importlib.resources.files("taehv_slurm.configs")))
    except ModuleNotFoundError:  # a checkout on PYTHONPATH, not installed: configs/ beside the package
        root = Path(__file__).resolve().parents[1] / "configs"
    candidate = root.joinpath(*parts[1:])
    return candidate if candidate.is_file() else None


