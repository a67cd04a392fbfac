"""Submit-time checks: what a job will need, checked on the login node before it waits in the queue.

Each check gives rows (check, PASS | WARN | FAIL | SKIP, detail), every FAIL naming what to change:

- machine:   a backend that runs here (--local) gets the GPUs its cluster config asks for;
- memory:    the plan's memory per rank against the GPU's, and host memory per node against the node's;
- resume:    the checkpoint a run would resume was trained with the same model and teacher;
- changed:   each value that differs from the run's last attempt (accepted, with what it changes);
- data:      the trainer's own readers on a sample of the data (taehv_slurm.trainer.data_checks, in a process
             of its own within `data_check_budget_s`: the submitting process imports no torch).

`submit_training` runs them and submits nothing when one FAILs (ChecksFailedError: one line per
problem); `taehv submit --dry-run` and `taehv preflight` print them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from taehv_slurm import container, snapshot
from taehv_slurm.backends import backend_named
from taehv_slurm.common.changes import config_changes, refusals
from taehv_slurm.common.config import ClusterConfig, ConfigError, TrainConfig
from taehv_slurm.common.machine import gpus_here, host_memory_here
from taehv_slurm.common.messages import first_line
from taehv_slurm.common.plan import GPU_MEMORY_HEADROOM, ScalePlan
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.common.train_config import CPU_TRAIN_CONFIG, missing_data_folder
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.provenance import read_attempts

RESULTS = ("PASS", "WARN", "FAIL", "SKIP")
# Host memory of one rank's process besides what it computes with: python, torch and its libraries
# (a CPU rank of the tiny config measured 0.55 GB RSS on the testbed; the CUDA context adds ~0.5 GB).
RANK_PROCESS_GB = {"cpu": 0.6, "cuda": 1.2}
LOADER_WORKER_GB = 0.3  # a forked loader worker's own pages (its clips are counted separately)
# On a CPU the plan's activation estimate (bf16, measured on GPUs) is held in fp32, without compile.
CPU_ACTIVATION_FACTOR = 2.0
DATA_CHECK_SAMPLE = 8
DATA_CHECK_START_S = 30.0  # beyond the budget: the check's process imports torch and the readers


@dataclasses.dataclass
class Row:
    check: str
    result: str  # PASS, WARN, FAIL or SKIP
    detail: str


class ChecksFailedError(ConfigError):
    """Some checks FAILed; `problems` holds one line each (the CLI prints them one per line)."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.problems = [f"{r.check}: {r.detail}" for r in rows if r.result == "FAIL"]
        super().__init__("; ".join(self.problems) + " (nothing was submitted)")


def table(rows: Sequence[Row]) -> str:
    width = max(len("check"), *(len(r.check) for r in rows))
    lines = [f"{'check'.ljust(width)}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{r.check.ljust(width)}  {r.result.ljust(6)}  {r.detail}" for r in rows]
    return "\n".join(lines)


def require_passing(rows: Sequence[Row]) -> None:
    if any(r.result == "FAIL" for r in rows):
        raise ChecksFailedError(rows)


def submit_checks(cluster: ClusterConfig, trains: Sequence[TrainConfig], plans: Sequence[ScalePlan],
                  run_dirs: Sequence[Path], data: bool | None = None) -> list[Row]:
    """Every check of a training submit (`run_dirs`: the runs' folders where known, else [])."""
    rows = machine_rows(cluster)
    rows += memory_rows(cluster, trains[0], plans[0])
    for train, run_dir in zip(trains, run_dirs):
        rows += resume_rows(run_dir, train)
    if not (cluster.check_data_on_submit if data is None else data):
        rows.append(Row("data", "SKIP", "check_data_on_submit is false: the job checks its data as it "
                                        "starts"))
        return rows
    seen = set()
    for train in trains:  # a sweep over the lr reads the same data once
        key = json.dumps([dataclasses.asdict(train.data), train.model.latent_channels], sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append(data_row(train, cluster.data_check_budget_s))
    return rows


def container_rows(cluster: ClusterConfig) -> list[Row]:
    """The container image the ranks run in: there (or a well-formed reference), with what they need
    mounted."""
    if not cluster.container_image:
        return []
    problem = container.image_problem(cluster) or container.mounts_problem(cluster, cluster.job_dir)
    if problem:
        return [Row("container", "FAIL", problem)]
    return [Row("container", "PASS", f"{cluster.container_runtime} runs the ranks in "
                                     f"{cluster.container_image} ({len(cluster.container_mounts)} mount(s)); "
                                     "Slurm's commands outside it")]


def snapshot_rows(cluster: ClusterConfig) -> list[Row]:
    """The code a Slurm job will import (taehv_slurm.snapshot): WARN for Python files git does not track,
    which the copy leaves out."""
    if not (cluster.code_snapshot and backend_named(cluster.backend).writes_sbatch_script):
        return []
    tree = snapshot.checkout()
    if tree is None:
        return []
    left_out = snapshot.untracked_modules(tree)
    if left_out:
        named = ", ".join(left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        return [Row("code", "WARN", f"{len(left_out)} Python file(s) of {tree.top} are not tracked by git "
                                    f"and not in the job's copy of the code ({named}): `git add` them, or "
                                    "--no-snapshot")]
    return [Row("code", "PASS", f"the job imports a copy of the {len(tree.files)} files git tracks in "
                                f"{tree.top}, as they are now")]


def machine_rows(cluster: ClusterConfig) -> list[Row]:
    """Where the ranks run: a backend that runs here must find the GPUs the cluster config asks for on this
    machine; a container image must be there, with the run folders mounted."""
    if not backend_named(cluster.backend).runs_here or cluster.gpus_per_node == 0 or cluster.device == "cpu":
        return container_rows(cluster) + snapshot_rows(cluster)
    have = gpus_here()
    if have >= cluster.gpus_per_node:
        return [Row("machine", "PASS", f"{have} GPU(s) here for {cluster.gpus_per_node} per node")]
    fix = ("use --cluster configs/cluster/local.yaml (CPU ranks) or submit to a cluster with GPUs" if not have
           else f"set --gpus-per-node {have}")
    return [Row("machine", "FAIL", f"the cluster config asks for {cluster.gpus_per_node} GPU(s) per node "
                                   f"but this machine has {have or 'none'}: {fix}")]


def memory_rows(cluster: ClusterConfig, train: TrainConfig, plan: ScalePlan) -> list[Row]:
    """The plan's memory per rank against the GPU's and host memory per node against the node's."""
    device = cluster.task_device()
    rows = []
    if device == "cuda":
        total, source = cluster.gpu_memory()
        need = plan.memory_per_gpu_gb
        ok = need <= total * GPU_MEMORY_HEADROOM
        rows.append(Row("GPU memory", "PASS" if ok else "FAIL",
                        f"≈{need:.1f} GB per rank (estimate) of {total:.0f} GB ({source})"
                        + ("" if ok else f": lower batch.per_gpu (now {plan.per_gpu_batch}) "
                                         "or set engine.activation_checkpointing true")))
    per_node = cluster.tasks_per_node or 1
    clip_gb = train.data.frames * 3 * train.data.height * train.data.width / 1e9
    workers = plan.num_workers * (LOADER_WORKER_GB + plan.prefetch_factor * plan.per_gpu_batch * clip_gb)
    compute = CPU_ACTIVATION_FACTOR * plan.memory_per_gpu_gb if device == "cpu" else 0.0
    need = per_node * (RANK_PROCESS_GB[device] + workers + compute)
    total, source = ((host_memory_here(), "this machine") if backend_named(cluster.backend).runs_here
                     else (cluster.mem_gb, "mem_gb"))
    what = f"≈{need:.1f} GB per node for {per_node} rank(s) (estimate)"
    if not total:
        rows.append(Row("host memory", "PASS", f"{what}; mem_gb not set: the partition's default applies"))
    elif need <= total:
        rows.append(Row("host memory", "PASS", f"{what} of {total:.0f} GB ({source})"))
    else:
        fix = ("lower batch.per_gpu, data.height/width or the ranks per node" if device == "cpu"
               else "raise mem_gb, or lower data.num_workers")
        if device == "cpu" and train.name != Path(CPU_TRAIN_CONFIG).stem:  # a GPU config here, no GPU
            fix += f", or train the CPU-sized config: --train {CPU_TRAIN_CONFIG}"
        rows.append(Row("host memory", "FAIL", f"{what} but {source} has {total:.0f} GB: {fix}"))
    return rows


def resume_rows(run_dir: Path, train: TrainConfig) -> list[Row]:
    """The run's checkpoint against the config (refusals), and what changed since its last attempt."""
    name = run_dir.name
    try:
        meta = Checkpointer(RunFolder(run_dir).checkpoints).read_meta() if run_dir.is_dir() else None
    except (OSError, ValueError) as err:
        return [Row("resume", "WARN", f"{name}: its latest checkpoint's meta.json is unreadable ({err}); the "
                                      "job moves that checkpoint aside and resumes from an older one")]
    attempts = read_attempts(run_dir) if run_dir.is_dir() else []
    if meta is None and not attempts:
        return [Row("resume", "PASS", f"{name}: a new run")]
    new = train.to_dict()
    rows = []
    if meta is not None:
        saved = meta.get("config") or {"model": meta.get("model", {})}
        where = f"its checkpoint (step {meta.get('step')})"
        rows += [Row("resume", "FAIL", f"{name}: {line}") for line in refusals(saved, new, where)]
        if not rows:
            rows.append(Row("resume", "PASS", f"{name}: resumes from step {meta.get('step')}"))
    recorded = [a["config"] for a in attempts if a.get("config")]
    last = recorded[-1] if recorded else (meta or {}).get("config")
    for change in config_changes(last or {}, new):
        if not (change.refused and meta is not None):  # a refusal is said once, above
            rows.append(Row("changed", "WARN" if change.note else "PASS", f"{name}: {change.line()}"))
    return rows


def data_row(train: TrainConfig, budget_s: float, sample: int = DATA_CHECK_SAMPLE) -> Row:
    """The trainer's readers on a sample of `train`'s data, in a process of their own (imports torch)."""
    if train.data.source == "synthetic":
        return Row("data", "SKIP", "data.source synthetic: clips are generated, nothing to read")
    if missing := missing_data_folder(train.data):  # no reader needed to say so: no process, no torch
        return Row("data", "FAIL", missing)
    request = json.dumps({"train": train.to_dict(), "sample": sample, "budget_s": budget_s})
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                       if p)}
    limit = budget_s + DATA_CHECK_START_S
    skip = "the job checks its data as it starts (check_data_on_submit: false skips this check)"
    try:
        done = subprocess.run([sys.executable, "-m", "taehv_slurm.trainer.data_checks"], input=request,
                              env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return Row("data", "WARN", f"the data check did not finish within {limit:.0f} s; {skip}")
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return Row("data", answer["result"], answer["detail"])
    except (IndexError, ValueError, KeyError, TypeError):
        error = first_line(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
        return Row("data", "WARN", f"the data check could not run ({error}); {skip}")
