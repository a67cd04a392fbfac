"""Typed configuration: cluster YAML → `ClusterConfig`, training YAML → `TrainConfig`.

The schemas and their validation live here; reading them (YAML or a dict, `--set key=value`
overrides, every problem as one `ConfigError` line naming the file or flag and the fix) is
taehv_slurm.typed_yaml's.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import importlib.util
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from taehv_slurm.machine import gpu_memory_here, gpus_here
from taehv_slurm.typed_yaml import ConfigError, load_typed

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

# What the data and teacher settings accept (checked here, used by the trainer, preflight and taehv prepare).
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov")
TeacherKind = Literal["none", "hunyuanvideo", "cogvideox", "wan"]
# the video VAEs (none: latents from shards)
TEACHER_KINDS: tuple[str, ...] = typing.get_args(TeacherKind)[1:]

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


def missing_engine_package(engine: str) -> str | None:
    """One line naming how to install what the engine needs when this interpreter lacks it, else None:
    the ZeRO engines need DeepSpeed, an optional extra (the default all-reduce engine needs none)."""
    if not engine.startswith("zero") or importlib.util.find_spec("deepspeed") is not None:
        return None
    return (f"engine {engine} needs DeepSpeed, which is not installed here: after torch, run pip install "
            "--no-build-isolation 'taehv-slurm[deepspeed]' (DeepSpeed builds from source), "
            "or set engine.kind: allreduce")


def missing_tracker_package(tracking: TrackingConfig) -> str | None:
    """One line naming how to install the trackers the config turns on when this interpreter lacks them."""
    missing = [m for m in ("wandb", "mlflow") if getattr(tracking, m) and importlib.util.find_spec(m) is None]
    off = ", ".join(f"tracking.{m}: false" for m in missing)
    return (f"tracking.{' and tracking.'.join(missing)}: {' and '.join(missing)} not installed here: "
            f"pip install 'taehv-slurm[trackers]', or set {off}" if missing else None)


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
        _check(self.nodes >= 1, source, f"nodes must be ≥ 1, got {self.nodes} (set nodes: 1 or more)")
        _check(self.gpus_per_node >= 0, source, f"gpus_per_node must be ≥ 0, got {self.gpus_per_node}")
        tasks = int(self.tasks_per_node or 0)
        _check(tasks >= 1, source, f"tasks_per_node must be ≥ 1, got {tasks}")
        if self.gpus_per_node > 0 and tasks != self.gpus_per_node and not self.allow_task_gpu_mismatch:
            raise ConfigError(
                f"{source}: tasks_per_node={tasks} but gpus_per_node={self.gpus_per_node}: "
                f"run one task per GPU (remove tasks_per_node or set it to {self.gpus_per_node}); "
                "set allow_task_gpu_mismatch: true only if you mean it"
            )
        _check(self.cpus_per_task >= 1, source, f"cpus_per_task must be ≥ 1, got {self.cpus_per_task}")
        _check(self.time_min >= 1, source, f"time_min must be ≥ 1, got {self.time_min}")
        _check(self.array_parallelism >= 1, source,
               f"array_parallelism must be ≥ 1, got {self.array_parallelism} "
               "(how many runs of a sweep may run at once)")
        _check(self.signal_delay_s >= SIGNAL_DELAY_MIN_S, source,
               f"signal_delay_s={self.signal_delay_s} is below the minimum of {SIGNAL_DELAY_MIN_S} s: "
               "the time-limit warning (USR2) must leave time to reach a step boundary, save and requeue; "
               "set signal_delay_s: "
               f"{SIGNAL_DELAY_MIN_S} or more (README: what a site must configure)")
        _check(
            self.signal_delay_s + SLURM_SIGNAL_EARLY_S < self.time_min * 60,
            source,
            f"time_min={self.time_min} leaves no time to train with signal_delay_s={self.signal_delay_s}: "
            f"Slurm sends the time-limit warning up to {SLURM_SIGNAL_EARLY_S} s before that, so it could "
            "come as the job starts, every time; raise time_min above "
            f"{(self.signal_delay_s + SLURM_SIGNAL_EARLY_S) // 60} or lower signal_delay_s",
        )
        _check(self.max_requeues >= 0, source, f"max_requeues must be ≥ 0, got {self.max_requeues}")
        _check(self.rendezvous_timeout_s >= 1, source, "rendezvous_timeout_s must be ≥ 1")
        _check(0.5 <= self.heartbeat_s <= self.hang_floor_s / 3, source,
               f"heartbeat_s={self.heartbeat_s} must be at least 0.5 and at most hang_floor_s / 3 "
               f"({self.hang_floor_s / 3:g}): a hang is told by records older than three heartbeats")
        margin = self.slow_rank_margin
        _check(self.hang_factor >= 1 and self.hang_uncalibrated_s >= self.hang_floor_s
               and (margin is None or margin > 0) and self.slow_rank_windows >= 0, source,
               "hang_factor must be ≥ 1, hang_uncalibrated_s ≥ hang_floor_s, slow_rank_margin > 0 and "
               "slow_rank_windows ≥ 0 (0: off)")
        _check(self.mem_gb is None or self.mem_gb > 0, source, f"mem_gb must be > 0, got {self.mem_gb}")
        if self.backend in MACHINE_BACKENDS and self.nodes > 1:
            raise ConfigError(
                f"{source}: backend '{self.backend}' runs on this machine only, but nodes={self.nodes}; "
                "set nodes: 1 or backend: slurm"
            )
        for name in self.env:
            _check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None, source,
                   f"env name {name!r} is not a valid variable name")
        return self


# ------------------------------------------------------------------------------------------- train


@dataclass
class DataConfig:
    source: Literal["synthetic", "video", "prepared"] = "synthetic"
    path: str | None = None  # a folder of videos (video) or of prepared shards (prepared)
    frames: int = 12
    height: int = 480
    width: int = 720
    num_clips: int = 4096  # synthetic source only
    val_clips: int = 16  # held-out clips for validation PSNR
    num_workers: int | None = None  # per GPU; None: the plan decides
    prefetch_factor: int | None = None


@dataclass
class ModelConfig:
    latent_channels: int = 16
    patch_size: int = 1
    encoder_width: int = 64
    decoder_widths: list[int] = field(default_factory=lambda: [256, 128, 64, 64])
    init_from: str | None = None  # published TAEHV weights (.pth or .safetensors) to start from


@dataclass
class TeacherConfig:
    # Where the distillation targets come from: latents stored by `taehv prepare` ("prepared"), or a
    # diffusers VAE run on the fly from a local folder (slow: ~5x the student's step; tests and small runs).
    kind: TeacherKind = "none"
    path: str | None = None
    scaling_factor: float | None = None  # None: the VAE config's value (HunyuanVideo 0.476986)


@dataclass
class LossConfig:
    latent_weight: float = 1.0  # MSE(student encoder, teacher latents)
    reconstruction_weight: float = 20.0  # MSE(decode(encode(x)), x): end to end
    decoder_weight: float = 0.0  # MSE(decode(teacher latents), x): the author's separate decoder objective


@dataclass
class OptimConfig:
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.01
    warmup_steps: int = 2000
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0
    # The effective batch is held constant across GPU counts, so lr does not change with the GPU count.
    # Only when you change effective_batch is lr rescaled from reference_batch by this rule.
    lr_scaling: Literal["none", "linear", "sqrt"] = "sqrt"
    reference_batch: int = 128


@dataclass
class BatchConfig:
    effective: int = 128  # = per_gpu × world size × grad accumulation, for any GPU count
    per_gpu: int = 4  # upper bound (fastest on H200); the plan lowers it when the world is large
    grad_accum: int | None = None  # explicit override; None: computed by the plan


@dataclass
class EngineConfig:
    # allreduce: replicated weights, one all-reduce of a flat gradient buffer per step ("ddp", the name
    # older configs use, is read as allreduce); zero1/2/3: DeepSpeed ZeRO; auto: the plan picks.
    kind: Literal["auto", "allreduce", "ddp", "zero1", "zero2", "zero3"] = "auto"
    precision: Literal["bf16", "fp32"] = "bf16"
    compile: bool = True  # torch.compile the model (CUDA only)
    # torch.compile mode for the allreduce engine: CUDA graphs ("reduce-overhead") measured fastest and
    # correct at any accumulation (docs/benchmarks.md); DeepSpeed engines always compile in "default" mode.
    # Not offered: max-autotune, whose autotuning had not finished after 6 minutes even at 128×192 clips and
    # kept cuDNN for every large convolution anyway.
    compile_mode: Literal["default", "reduce-overhead"] = "reduce-overhead"
    channels_last: bool = True  # (CUDA only)
    activation_checkpointing: bool = False


@dataclass
class IntervalConfig:
    log_every: int = 25
    val_every: int = 1000
    # "auto": the plan's interval for the GPU count, from the failure rate at that scale and the save time
    # (Young's formula; docs/failures.md), at most an hour of training
    ckpt_every: int | Literal["auto"] = 2000
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    # samples.jsonl: the clip indices of every step (all ranks, in rank order), to check the data order;
    # one small gather per step
    record_samples: bool = False


@dataclass
class DivergenceConfig:
    # A step whose loss or gradient norm is not finite is skipped on every rank (never applied). Past
    # the budget the run stops (FAILED, one line naming the step and the last checkpoint), or with
    # action: rollback restores the last checkpoint and skips the batches since it (at most
    # max_rollbacks times, then stops).
    action: Literal["stop", "rollback"] = "stop"
    max_consecutive: int = 3  # skipped steps in a row
    max_in_window: int = 10  # ... or skipped steps within the last `window` steps
    window: int = 200
    max_rollbacks: int = 2


@dataclass
class TrackingConfig:
    # W&B / MLflow beside TensorBoard (rank 0): one tracker run per training run across every requeue and
    # resubmit, its id kept in <run>/trackers.json (taehv_slurm.trainer.trackers). The `trackers` extra.
    wandb: bool = False
    wandb_project: str = "taehv"
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"  # offline: `wandb sync <run>/wandb/offline-run-*`
    mlflow: bool = False
    mlflow_tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else a file store in <run>/mlruns
    mlflow_experiment: str = "taehv"
    sample_frames: int = 4  # val/sample, to TensorBoard too: clip 0's frames over their reconstruction


@dataclass
class TrainConfig:
    name: str = "taehv"
    seed: int = 0
    steps: int = 100_000
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    intervals: IntervalConfig = field(default_factory=IntervalConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    # A train YAML file must name these: an empty file would otherwise train the full-size defaults.
    REQUIRED_KEYS: ClassVar[tuple[str, ...]] = ("name", "steps", "data.source", "batch.effective")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_fields(self) -> dict[str, Any]:
        """What fixes the shapes of the model's weights: a checkpoint loads only into the same values."""
        m = self.model
        return {"latent_channels": m.latent_channels, "patch_size": m.patch_size,
                "encoder_width": m.encoder_width, "decoder_widths": list(m.decoder_widths)}

    def validate(self, source: str = "train config") -> TrainConfig:
        d, b = self.data, self.batch
        if self.engine.kind == "ddp":
            self.engine.kind = "allreduce"
        _check(self.steps >= 1, source, f"steps must be ≥ 1, got {self.steps}")
        _check(d.frames >= 4 and d.frames % 4 == 0, source,
               f"data.frames must be a multiple of 4 (≥ 4), got {d.frames}")
        _check(d.height % 8 == 0 and d.width % 8 == 0 and d.height > 0 and d.width > 0, source,
               f"data.height and data.width must be positive multiples of 8, got {d.height}×{d.width}")
        if d.source in ("video", "prepared"):
            _check(bool(d.path), source, f"data.source={d.source} needs data.path (a folder)")
        _check(b.effective >= 1 and b.per_gpu >= 1, source, "batch.effective and batch.per_gpu must be ≥ 1")
        _check(b.grad_accum is None or b.grad_accum >= 1, source, "batch.grad_accum must be ≥ 1")
        if self.teacher.kind != "none":
            _check(bool(self.teacher.path), source,
                   f"teacher.kind={self.teacher.kind} needs teacher.path (a local diffusers VAE folder)")
        _check(self.optim.lr > 0, source, f"optim.lr must be > 0, got {self.optim.lr}")
        _check(len(self.optim.betas) == 2, source, "optim.betas needs two values, e.g. [0.9, 0.95]")
        counted = [] if self.intervals.ckpt_every == "auto" else ["ckpt_every"]
        for key in ("log_every", "val_every", *counted, "keep_checkpoints"):
            value = getattr(self.intervals, key)
            _check(value >= 1, source, f"intervals.{key} must be ≥ 1, got {value}")
        for key in ("max_consecutive", "max_in_window", "window"):
            value = getattr(self.divergence, key)
            _check(value >= 1, source, f"divergence.{key} must be ≥ 1, got {value}")
        _check(self.divergence.max_rollbacks >= 0, source, "divergence.max_rollbacks must be ≥ 0")
        _check(self.tracking.sample_frames >= 0, source,
               f"tracking.sample_frames must be ≥ 0 (0: none), got {self.tracking.sample_frames}")
        return self


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


def _check(ok: bool, source: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{source}: {message}")
