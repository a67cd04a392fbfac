"""The scale plan: one training config → the settings for ANY number of nodes and GPUs.

Pure functions, no I/O. The effective batch E (samples per optimizer step) is held constant, so the
optimisation is the same on 1 GPU or 1000 and a run can resume at another world size. What changes
with the GPU count is only how the batch is split, the engine that fits, the loader and the NCCL
settings for the node count.

The split, for any world size W ≤ E: every rank takes ⌊E/W⌋ samples of each step and the first E mod W
ranks one more (128 over 24 GPUs: 16 ranks × 5 + 8 ranks × 6). A rank cuts its share into micro-batches
of at most `batch.per_gpu` (the last may be smaller); every rank runs the same number of them, the
most any rank needs (DeepSpeed's ZeRO stages run collectives inside each micro-step, so a DeepSpeed
rank with fewer samples pads with a micro-batch of weight 0). The trainer weights each micro-batch's
loss by its samples / E, so one step's gradient is the mean over exactly E samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from taehv_slurm.common.config import ClusterConfig, ConfigError, TrainConfig, load_train
from taehv_slurm.common.messages import command

# The engines in the order the plan prefers them when several fit: the fewest collectives and gathers per
# step first. ZeRO buys no memory worth its cost for an 11 M-parameter model, so the plan takes allreduce
# (plain data parallelism) and moves to ZeRO only when parameters + optimizer states do not fit.
ENGINES = ("allreduce", "zero1", "zero2", "zero3")
# Clips/s per GPU of an engine against allreduce's, measured with this model's isolated eager step at batch 4
# on one H200 (bench/train_throughput.py --variants eager_cl --engines allreduce,zero2: 29.86 against 20.87,
# bench/results/engines_h200_2026-11-23_11f044c.json). ZeRO-1 and ZeRO-3 have no kept measurement: the plan
# prints no figure for them.
MEASURED_ENGINE_SPEED = {"zero2": 20.87 / 29.86}
# Engines that torch.compile their step where engine.compile is on (GPUs). ZeRO-3 gathers each partitioned
# weight when it is read; the model composes weights from several layers outside those layers' calls, so
# the compiler traces the partitions instead (on an H200 the compiled ZeRO-3 step failed at its first
# trace, docs/benchmarks.md): ZeRO-3 runs uncompiled.
COMPILED_ENGINES = ("allreduce", "zero1", "zero2")
# Activation memory of one 12×480×720 clip in a bf16 training step (encoder + decoder, forward +
# backward, torch.compile), measured on H200: peak 35.1 GiB at batch 8 → 4.4 GiB per clip (17.5 GiB
# at batch 4). Scales with frames × pixels.
ACTIVATION_GB_PER_REFERENCE_CLIP = 4.4
REFERENCE_CLIP_ELEMENTS = 12 * 480 * 720
# Activation checkpointing keeps about a third of the activations (the block inputs), measured shape.
CHECKPOINTED_ACTIVATION_FRACTION = 0.35
GPU_MEMORY_HEADROOM = 0.9  # leave 10 % for the allocator, NCCL buffers and compile workspaces
# Loading, measured on a 16-core H100 host (bench/loader_throughput.py, docs/benchmarks.md): clips/s that
# one loader worker delivers for each source at the reference clip (12×480×720) while 8 workers run at
# once (video 15.2, synthetic 3.75, prepared 53.7; one worker alone: 21, 5.9, 97). Raw video: PyAV decode
# with its threads; synthetic: rendered with numpy; prepared: shards from the page cache. The trainer
# takes ~55 clips/s per H100/H200 (docs/benchmarks.md).
CLIPS_PER_WORKER = {"video": 15.0, "synthetic": 3.7, "prepared": 53.0}
TRAIN_CLIPS_PER_GPU = 55.0
LOADER_HEADROOM = 1.25  # workers for 25 % more than the GPU takes: load times vary clip to clip

NCCL_TIMEOUT_BY_NODES = ((1, 3600), (2, 7200), (8, 14400))  # (from this many nodes, seconds)
# Failures at scale, for the checkpoint interval: Llama 3's pretraining saw 466 job interruptions in 54
# days on 16,384 H100s (Dubey et al., 2024, "The Llama 3 Herd of Models", section 3.3.4): one per this
# many GPU-seconds.
GPU_SECONDS_PER_INTERRUPTION = 54 * 86400 * 16384 / 466
# A save of the ~135 MB state (gathered, written by rank 0): 0.23 s a periodic save, 0.4–0.5 s from the signal
# to saved, on one H200 (docs/benchmarks.md).
SAVE_SECONDS = 0.5
MAX_CHECKPOINT_INTERVAL_S = 3600.0  # whatever the scale: a hang or a lost node costs at most an hour


@dataclass(frozen=True)
class ScalePlan:
    num_nodes: int
    gpus_per_node: int
    world_size: int
    per_gpu_batch: int
    grad_accum: int
    effective_batch: int
    lr: float
    warmup_steps: int
    total_steps: int
    min_share: int  # samples of one step on the ranks with the fewest (⌊E/W⌋)
    ranks_with_extra: int  # the first E mod W ranks take min_share + 1
    engine: str
    engine_reason: str
    precision: str
    memory_per_gpu_gb: float
    nccl_timeout_s: int
    nccl_env: dict[str, str] = field(default_factory=dict)
    num_workers: int = 0
    prefetch_factor: int = 2
    log_every: int = 25
    val_every: int = 1000
    ckpt_every: int = 2000
    ckpt_interval_s: float | None = None  # intervals.ckpt_every: auto — the interval it stands for
    notes: list[str] = field(default_factory=list)
    lost_node: str = ""  # what the job does when a node fails (plan_for_cluster; "" for a bare plan)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def share(self, rank: int) -> int:
        """Samples rank `rank` contributes to one optimizer step."""
        return self.min_share + (1 if rank < self.ranks_with_extra else 0)

    def first_sample(self, rank: int) -> int:
        """Where rank `rank`'s share starts among the step's E samples (ranks take consecutive ranges)."""
        return rank * self.min_share + min(rank, self.ranks_with_extra)

    def microbatch_sizes(self, rank: int) -> list[int]:
        """Rank `rank`'s micro-batches of one step: `per_gpu_batch` each, the last possibly smaller.

        DeepSpeed engines get exactly `grad_accum` entries (0 = a padding micro-batch of weight 0);
        the allreduce engine runs only the micro-batches that hold samples.
        """
        share, size = self.share(rank), self.per_gpu_batch
        sizes = [size] * (share // size) + ([share % size] if share % size else [])
        if self.engine.startswith("zero"):
            sizes += [0] * (self.grad_accum - len(sizes))
        return sizes

    def split_text(self) -> str:
        """`128 = 16 ranks × 5 + 8 ranks × 6; micro-batch ≤ 4, 2 per step`."""
        extra, even = self.ranks_with_extra, self.world_size - self.ranks_with_extra
        parts = [f"{n} rank{'s' if n != 1 else ''} × {share}"
                 for n, share in ((even, self.min_share), (extra, self.min_share + 1)) if n]
        uneven = extra or self.min_share % self.per_gpu_batch
        micro = f"micro-batch {'≤ ' if uneven else ''}{self.per_gpu_batch}, {self.grad_accum} per step"
        return f"{self.effective_batch} = {' + '.join(parts)}; {micro}"

    def table(self) -> str:
        """A two-column table for `taehv submit --dry-run` and notebooks."""
        auto = (f" (ckpt auto: ≈{self.ckpt_interval_s / 60:.0f} min, least lost to failures at this scale; "
                "docs/failures.md)" if self.ckpt_interval_s else "")
        rows = [
            ("GPUs", f"{self.world_size} = {self.num_nodes} node(s) × {self.gpus_per_node}"),
            ("effective batch", self.split_text()),
            ("lr / warmup", f"{self.lr:.3g} / {self.warmup_steps} steps (of {self.total_steps})"),
            ("engine", f"{self.engine} ({self.engine_reason})"),
            ("precision", self.precision),
            ("memory per GPU", f"≈{self.memory_per_gpu_gb:.1f} GB (estimate)"),
            ("collective timeout", f"{self.nccl_timeout_s} s"),
            ("NCCL env", " ".join(f"{k}={v}" for k, v in self.nccl_env.items()) or "-"),
            ("loader", f"{self.num_workers} workers/GPU, prefetch {self.prefetch_factor}"),
            ("log / val / ckpt",
             f"every {self.log_every} / {self.val_every} / {self.ckpt_every} steps{auto}"),
        ] + [("a lost node", self.lost_node)] * bool(self.lost_node) + [("note", note) for note in self.notes]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def plan_for(num_nodes: int, gpus_per_node: int, train: TrainConfig | Mapping[str, Any] | None = None, *,
             gpu_memory_gb: float = 80.0, cpus_per_task: int | None = None,
             device: str = "cuda") -> ScalePlan:
    """The plan for `num_nodes` × `gpus_per_node` ranks.

    gpus_per_node is the number of ranks per node (one per GPU); 0 means one rank per node. With
    device="cpu" (tests, CPU-only nodes) there is no GPU memory limit, fp32 and no NCCL settings.
    """
    cfg = train if isinstance(train, TrainConfig) else load_train(train or {})
    if num_nodes < 1:
        raise ConfigError(f"nodes must be ≥ 1, got {num_nodes}")
    if gpus_per_node < 0:
        raise ConfigError(f"gpus_per_node must be ≥ 0, got {gpus_per_node}")
    ranks_per_node = max(1, gpus_per_node)
    world = num_nodes * ranks_per_node
    per_gpu, accum = _split_batch(cfg, world, ranks_per_node, num_nodes)

    act_gb = _activation_gb(cfg, per_gpu)
    on_gpu = gpus_per_node > 0 and device != "cpu"
    engine, reason, states_gb = _choose_engine(cfg, world, per_gpu, act_gb, gpu_memory_gb if on_gpu else None)
    timeout = max(t for n, t in NCCL_TIMEOUT_BY_NODES if num_nodes >= n)
    nccl_env = _nccl_env(num_nodes) if on_gpu else {}
    workers, prefetch, notes = _loader_settings(cfg, cpus_per_task, on_gpu)
    if on_gpu and cfg.engine.compile and engine not in COMPILED_ENGINES:
        notes.append(f"{engine} runs without torch.compile (it gathers each weight when read, which the "
                     f"compiler cannot trace here); {', '.join(COMPILED_ENGINES)} compile")
    auto_interval = checkpoint_interval_s(world) if cfg.intervals.ckpt_every == "auto" else None
    scale = _lr_scale(cfg)
    return ScalePlan(
        num_nodes=num_nodes,
        gpus_per_node=gpus_per_node,
        world_size=world,
        per_gpu_batch=per_gpu,
        grad_accum=accum,
        effective_batch=cfg.batch.effective,
        min_share=cfg.batch.effective // world,
        ranks_with_extra=cfg.batch.effective % world,
        lr=cfg.optim.lr * scale,
        warmup_steps=cfg.optim.warmup_steps,
        total_steps=cfg.steps,
        engine=engine,
        engine_reason=reason,
        precision=cfg.engine.precision if on_gpu else "fp32",
        memory_per_gpu_gb=round(states_gb + act_gb, 2),
        nccl_timeout_s=timeout,
        nccl_env=nccl_env,
        num_workers=workers,
        prefetch_factor=prefetch,
        log_every=cfg.intervals.log_every,
        val_every=cfg.intervals.val_every,
        ckpt_every=(checkpoint_every(cfg, world) if cfg.intervals.ckpt_every == "auto"
                    else int(cfg.intervals.ckpt_every)),
        ckpt_interval_s=auto_interval,
        notes=notes,
    )


def _choose_engine(cfg: TrainConfig, world: int, per_gpu: int, act_gb: float,
                   gpu_memory_gb: float | None) -> tuple[str, str, float]:
    """(engine, why, its state GB per GPU): the configured one if it fits, else the fastest that fits
    (`gpu_memory_gb` None: no GPU memory limit, as on CPUs)."""
    states_gb = {name: _state_bytes(name, cfg, world) / 1e9 for name in ENGINES}
    fits = {e: gpu_memory_gb is None or states_gb[e] + act_gb <= gpu_memory_gb * GPU_MEMORY_HEADROOM
            for e in ENGINES}
    if cfg.engine.kind != "auto":
        engine = cfg.engine.kind
        if not fits[engine]:
            raise ConfigError(
                f"engine {engine} needs ≈{states_gb[engine] + act_gb:.0f} GB per GPU with per-GPU batch "
                f"{per_gpu} but {gpu_memory_gb:.0f} GB are available: lower batch.per_gpu "
                "or set engine.kind: auto"
            )
        return engine, "set in the config", states_gb[engine]
    fitting = [e for e in ENGINES if fits[e]]
    if not fitting:
        raise ConfigError(
            f"no engine fits {gpu_memory_gb:.0f} GB per GPU at per-GPU batch {per_gpu} "
            f"(activations ≈{act_gb:.0f} GB): lower batch.per_gpu or enable engine.activation_checkpointing"
        )
    engine = fitting[0]
    measured = ", ".join(f"{e} {100 * (MEASURED_ENGINE_SPEED[e] - 1):+.0f} %" for e in MEASURED_ENGINE_SPEED)
    reason = (f"fastest that fits; measured vs allreduce (an eager step on one H200): {measured}"
              if engine == "allreduce"
              else f"allreduce does not fit; {engine} does")
    return engine, reason, states_gb[engine]


def _nccl_env(num_nodes: int) -> dict[str, str]:
    """NCCL settings for the node count (GPU runs only)."""
    env = {
        "NCCL_BUFFSIZE": str((32 if num_nodes >= 8 else 16) * 1024 * 1024),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a timed-out collective raises instead of hanging
        # NCCL's flight recorder: the last collectives of each rank, dumped into a hang's bundle
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if num_nodes > 1:
        env["NCCL_IB_TIMEOUT"] = "22"  # longer IB retry window on large fabrics
    return env


def checkpoint_interval_s(gpus: int, save_s: float = SAVE_SECONDS) -> float:
    """Seconds between checkpoints that cost the least at this scale: Young's first-order optimum
    sqrt(2 × save time × the job's mean time between interruptions), at most an hour."""
    return min(MAX_CHECKPOINT_INTERVAL_S, math.sqrt(2 * save_s * GPU_SECONDS_PER_INTERRUPTION / max(1, gpus)))


def checkpoint_every(cfg: TrainConfig, gpus: int) -> int:
    """`intervals.ckpt_every: auto`: the optimal interval in steps, at the measured training rate."""
    pixels = cfg.data.frames * cfg.data.height * cfg.data.width / REFERENCE_CLIP_ELEMENTS
    step_s = cfg.batch.effective * pixels / (max(1, gpus) * TRAIN_CLIPS_PER_GPU)
    return max(1, round(checkpoint_interval_s(gpus) / step_s))


def plan_for_cluster(cluster: ClusterConfig, train: TrainConfig | Mapping[str, Any]) -> ScalePlan:
    """The plan for a cluster config's shape, GPU memory and cores, on its tasks' device; with what the job
    does when a node fails. A `min_nodes` the run could not go on with (its batch split, its memory) is a
    ConfigError now, not at the fault."""
    def plan(nodes: int) -> ScalePlan:
        return plan_for(nodes, int(cluster.tasks_per_node or 1), train,
                        gpu_memory_gb=cluster.gpu_memory()[0], cpus_per_task=cluster.cpus_per_task,
                        device=cluster.task_device())

    full, fewest = plan(cluster.nodes), cluster.fewest_nodes
    if fewest < cluster.nodes:
        try:
            smaller = plan(fewest)
        except ConfigError as err:
            raise ConfigError(f"min_nodes={fewest}: the run could not go on with {fewest} node(s): "
                              f"{err}") from None
        shrink = (f"goes on with as few as {fewest} node(s) at the same effective batch "
                  f"({smaller.grad_accum} micro-batches per step there); back to full size at its next "
                  "requeue")
    if cluster.backend != "slurm":
        return full
    if not cluster.restart_in_allocation:
        lost = "the job is requeued without it"
    elif cluster.spare_nodes:
        lost = (f"a spare takes its place inside the job ({cluster.spare_nodes} spare node(s), held idle)"
                + (f"; without spares it {shrink}" if fewest < cluster.nodes else ""))
    elif fewest < cluster.nodes:
        lost = f"the job {shrink}"
    else:
        lost = "the job is requeued without it (--spare-nodes K keeps it in its allocation; or set min_nodes)"
    if cluster.restart_in_allocation:
        lost += "; a rank's failure restarts the ranks inside the job"
    return dataclasses.replace(full, lost_node=lost)


def _split_batch(cfg: TrainConfig, world: int, ranks_per_node: int, num_nodes: int) -> tuple[int, int]:
    """(largest micro-batch, micro-batches per step) for `world` ranks; see the module docstring."""
    effective, cap, accum = cfg.batch.effective, cfg.batch.per_gpu, cfg.batch.grad_accum
    if world > effective:
        most_nodes = effective // ranks_per_node
        fewer = (f"{most_nodes} node(s) × {ranks_per_node} = {most_nodes * ranks_per_node} GPUs" if most_nodes
                 else f"{effective} GPUs")
        raise ConfigError(
            f"effective batch {effective} cannot be split over {world} GPUs "
            f"({num_nodes} node(s) × {ranks_per_node}): "
            f"each rank needs at least one sample per step; use at most {fewer}, or set batch.effective to "
            f"{world} or more (another run: lr follows optim.lr_scaling)"
        )
    largest_share = -(-effective // world)
    if accum is not None:
        if accum > largest_share:
            raise ConfigError(
                f"batch.grad_accum={accum} asks for more micro-batches than the {largest_share} samples "
                f"a rank takes per step ({effective} over {world} GPUs): remove batch.grad_accum or set it "
                f"to at most {largest_share}"
            )
        return -(-largest_share // accum), accum
    per_gpu = min(cap, largest_share)
    return per_gpu, -(-largest_share // per_gpu)


def taehv_param_count(cfg: TrainConfig) -> int:
    """Parameters of the TAEHV student for this config, counted from its layer shapes."""
    m = cfg.model
    conv3 = lambda cin, cout, bias=True: cin * cout * 9 + (cout if bias else 0)  # noqa: E731
    def memblock(c: int) -> int:
        return conv3(2 * c, c) + 2 * conv3(c, c)
    e, pix = m.encoder_width, 3 * m.patch_size**2
    tpool = [2, 2, 1]
    enc = (conv3(pix, e) + sum(e * s * e + conv3(e, e, False) + 3 * memblock(e) for s in tpool)
           + conv3(e, m.latent_channels))
    w = m.decoder_widths
    tgrow = [1, 2, 2]
    dec = conv3(m.latent_channels, w[0])
    for i in range(3):
        dec += 3 * memblock(w[i]) + w[i] * w[i] * tgrow[i] + conv3(w[i], w[i + 1], False)
    dec += conv3(w[3], pix)
    return enc + dec


def _state_bytes(engine: str, cfg: TrainConfig, world: int) -> float:
    p = taehv_param_count(cfg)
    weights, grads, adam = 4.0 * p, 4.0 * p, 8.0 * p  # fp32 master weights, grads, two Adam moments
    if engine == "zero1":
        return weights + grads + adam / world
    if engine == "zero2":
        return weights + (grads + adam) / world
    if engine == "zero3":
        return (weights + grads + adam) / world
    return weights + grads + adam


def _activation_gb(cfg: TrainConfig, per_gpu: int) -> float:
    d = cfg.data
    elements = d.frames * d.height * d.width
    gb = ACTIVATION_GB_PER_REFERENCE_CLIP * elements / REFERENCE_CLIP_ELEMENTS * per_gpu
    if cfg.engine.precision == "fp32":
        gb *= 2
    if cfg.engine.activation_checkpointing:
        gb *= CHECKPOINTED_ACTIVATION_FRACTION
    return gb


def _loader_settings(cfg: TrainConfig, cpus_per_task: int | None, on_gpu: bool) -> tuple[int, int, list[str]]:
    """(workers per rank, prefetch per worker, notes): enough workers to feed the GPU at the measured
    per-worker rate of the source, out of the rank's CPUs (one core drives the GPU)."""
    d = cfg.data
    cpus = cpus_per_task or 8
    spare = max(0, cpus - 1)
    notes = []
    if on_gpu:
        pixels = d.frames * d.height * d.width / REFERENCE_CLIP_ELEMENTS
        wanted = max(1, math.ceil(TRAIN_CLIPS_PER_GPU * pixels * LOADER_HEADROOM
                                  / CLIPS_PER_WORKER[d.source]))
        auto_workers = min(spare, wanted)
        if d.num_workers is None and wanted > spare:
            fix = {"video": f"or prepare the data once with `{command('prepare')}`",
                   "synthetic": "(synthetic clips are rendered on the CPU; prepared data needs far fewer)",
                   "prepared": "or read the shards from faster storage"}[d.source]
            notes.append(f"the loader needs ≈{wanted + 1} CPU cores per GPU to keep the GPU busy "
                         f"(cpus_per_task={cpus} gives {auto_workers} workers): raise cpus_per_task {fix}")
    else:  # the CPU trains far slower than it loads: a couple of workers, none for tiny clips
        auto_workers = min(spare, 2) if d.height * d.width >= 256 * 256 or d.source == "video" else 0
    prefetch = d.prefetch_factor if d.prefetch_factor is not None else 4
    workers = d.num_workers if d.num_workers is not None else auto_workers
    return workers, prefetch, notes


def _lr_scale(cfg: TrainConfig) -> float:
    ratio = cfg.batch.effective / cfg.optim.reference_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.optim.lr_scaling]
