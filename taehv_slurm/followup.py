"""Follow-up jobs: how a run goes on where Slurm does not requeue it.

Some clusters never requeue a job (PreemptMode=CANCEL: a preemption ends it; JobRequeue=0; a job_submit
plugin that forces --no-requeue) or refuse `scontrol requeue`. There the cluster config's `requeue:
follow_up` (chosen by `auto` at submit when the cluster says so, or at the fault when Slurm refuses the
requeue) makes the job, after every rank saved, submit its next attempt as a new job:

    sbatch --dependency=afternotok:JOB --kill-on-invalid-dep=yes [--array=TASK] [--exclude=NODES] SCRIPT

the job's own batch script, run folder and pickle (copied under the new id), with the batch script's
environment less the job's own variables, run by the job's Slurm relay outside any container. It starts once
this job has ended in a failed state — preempted, timed out, killed, or exited with FOLLOW_UP_EXIT_CODE as
this one then does — and Slurm removes it if this job completes. The registry records it as a job of the
same run that `follows` this one, so `taehv status` shows the chain as one run and goodput counts every
attempt of it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from taehv_slurm import slurm
from taehv_slurm.common.config import ClusterConfig
from taehv_slurm.registry import Registry, record_submission, run_name
from taehv_slurm.runtime.rank_backend import Outcome

MODES = ("auto", "self", "follow_up")


def resolve_mode(cluster: ClusterConfig, asks_slurm: bool) -> str:
    """The requeue mode a job of `cluster` is submitted with (`asks_slurm`: its backend is Slurm's): `auto`
    becomes follow_up where the cluster does not requeue jobs (its partition's PreemptMode has CANCEL, or
    JobRequeue=0), and stays auto (requeue, follow-up if refused) where it does or cannot be asked."""
    if cluster.requeue != "auto" or not asks_slurm:
        return cluster.requeue
    config = slurm.show_config()
    if not isinstance(config, dict):
        return "auto"
    preempt = partition_preempt_mode(cluster.partition) or config.get("PreemptMode", "OFF")
    return "auto" if slurm.site_requeues({**config, "PreemptMode": preempt}) else "follow_up"


def partition_preempt_mode(partition: str | None) -> str | None:
    """The PreemptMode of `partition` (the default partition for None), None where Slurm does not say."""
    answer = slurm.run_scontrol("show", "partition", "-o", *([partition] if partition else []), timeout_s=30)
    for line in answer.output.splitlines() if answer.ok else []:
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if partition or fields.get("Default") == "YES":
            return fields.get("PreemptMode")
    return None


def submit(job_id: str, job_dir: str | None, fields: dict[str, Any], exclude: Sequence[str] = (),
           refused: str | None = None) -> Outcome:
    """Submit job `job_id`'s next attempt as a follow-up job (from inside the job: its submitit folder is
    SUBMITIT_FOLDER); the `requeue` event's outcome, or `requeue_failed` with sbatch's answer."""
    folder = Path(os.environ["SUBMITIT_FOLDER"])
    array = job_id.partition("_")[0]
    script = folder / f"{array}_submission.sh"
    answer = slurm.submit_follow_up(script, job_id, exclude, cwd=os.environ.get("SLURM_SUBMIT_DIR"))
    extra = {"requeue_refused": refused} if refused else {}
    if not answer.ok:
        return Outcome("requeue_failed", {**fields, **extra,
                                          "error": f"sbatch of the follow-up job: {answer.error}",
                                          "fix": "submit the run again with the same --name: it resumes"})
    new = answer.output
    new_array = new.partition("_")[0]
    # The follow-up waits for this job to end: its files are in place long before it can start.
    shutil.copyfile(folder / f"{job_id}_submitted.pkl", folder / f"{new}_submitted.pkl")
    if not (folder / f"{new_array}_submission.sh").exists():
        shutil.copyfile(script, folder / f"{new_array}_submission.sh")
    if job_dir:
        record = Registry.load(job_dir).find(job_id)
        rest = {k: v for k, v in record.items() if k not in ("job_id", "run", "follows", "event", "time")}
        record_submission(job_dir, {"job_id": new, "run": run_name(record), "follows": job_id, **rest,
                                    "submitted_at": time.time()})
    return Outcome("requeue", {**fields, **extra, "by": "follow-up", "follow_up": new,
                               **({"excluded": list(exclude)} if exclude else {})})
