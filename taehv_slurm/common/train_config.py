"""The training config's schema: training YAML → `TrainConfig` (loaded by
taehv_slurm.common.config.load_train).

Every field with its default and meaning; `TrainConfig.validate` says in one line what is wrong and how to
fix it. What the data and teacher settings accept is defined here and used by the trainer, preflight and
`taehv prepare`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from taehv_slurm.common.messages import command
from taehv_slurm.common.typed_yaml import check

# What the data and teacher settings accept (checked here, used by the trainer, preflight and taehv prepare).
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov")
# The shipped CPU-sized config (its `name` is its file's stem): what trains on a machine without a GPU.
CPU_TRAIN_CONFIG = "configs/train/tiny.yaml"
TeacherKind = Literal["none", "hunyuanvideo", "cogvideox", "wan"]
# the video VAEs (none: latents from shards)
TEACHER_KINDS: tuple[str, ...] = typing.get_args(TeacherKind)[1:]


def video_folder_missing(root: object, extensions: typing.Sequence[str] = VIDEO_EXTENSIONS) -> str:
    """The video reader's error for a folder that is not there (trainer.data.VideoFolderClips)."""
    return (f"video folder {str(root)!r} does not exist or is not a directory; "
            f"point the data root at a folder of {'/'.join(extensions)} files")


def prepared_folder_missing(out: object) -> str:
    """The prepared reader's error for a folder that is not there (trainer.manifest.read_manifest_info)."""
    return (f"prepared data folder {out} does not exist; prepare it with "
            f"`{command('prepare')} --data VIDEOS --out {out} --teacher-path VAE`")


def missing_data_folder(data: DataConfig) -> str | None:
    """The readers' one-line error (`ValueError: ...`, as the data check shows it) for a data folder that is
    not there, else None: found before a process starts or torch is imported."""
    if data.source == "synthetic" or os.path.isdir(data.path or ""):
        return None
    missing = video_folder_missing if data.source == "video" else prepared_folder_missing
    return f"ValueError: {missing(data.path)}"


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
    # resubmit, its id kept in the run folder (taehv_slurm.trainer.trackers). The `trackers` extra.
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
        check(self.steps >= 1, source, f"steps must be ≥ 1, got {self.steps}")
        check(d.frames >= 4 and d.frames % 4 == 0, source,
               f"data.frames must be a multiple of 4 (≥ 4), got {d.frames}")
        check(d.height % 8 == 0 and d.width % 8 == 0 and d.height > 0 and d.width > 0, source,
               f"data.height and data.width must be positive multiples of 8, got {d.height}×{d.width}")
        if d.source in ("video", "prepared"):
            check(bool(d.path), source, f"data.source={d.source} needs data.path (a folder)")
        check(b.effective >= 1 and b.per_gpu >= 1, source, "batch.effective and batch.per_gpu must be ≥ 1")
        check(b.grad_accum is None or b.grad_accum >= 1, source, "batch.grad_accum must be ≥ 1")
        if self.teacher.kind != "none":
            check(bool(self.teacher.path), source,
                   f"teacher.kind={self.teacher.kind} needs teacher.path (a local diffusers VAE folder)")
        check(self.optim.lr > 0, source, f"optim.lr must be > 0, got {self.optim.lr}")
        check(len(self.optim.betas) == 2, source, "optim.betas needs two values, e.g. [0.9, 0.95]")
        counted = [] if self.intervals.ckpt_every == "auto" else ["ckpt_every"]
        for key in ("log_every", "val_every", *counted, "keep_checkpoints"):
            value = getattr(self.intervals, key)
            check(value >= 1, source, f"intervals.{key} must be ≥ 1, got {value}")
        for key in ("max_consecutive", "max_in_window", "window"):
            value = getattr(self.divergence, key)
            check(value >= 1, source, f"divergence.{key} must be ≥ 1, got {value}")
        check(self.divergence.max_rollbacks >= 0, source, "divergence.max_rollbacks must be ≥ 0")
        check(self.tracking.sample_frames >= 0, source,
               f"tracking.sample_frames must be ≥ 0 (0: none), got {self.tracking.sample_frames}")
        return self
