"""The job registry: `<job_dir>/registry.jsonl`, one line per submitted run.

Each line holds the job id, the run folder and submitit folder (relative to job_dir, so a job_dir can
be read from any working directory), the backend, the shape, the secret-free cluster config and what
the submitter recorded (train config, plan, swept values). `JobHandle.attach` re-opens a run from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from taehv_slurm.runtime.runfiles import EventLog

REGISTRY = "registry.jsonl"


class UnknownJobError(LookupError):
    """No run with that job id in the registry; the message says where it looked and what to pass."""


def read_registry(job_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every submission recorded in `<job_dir>/registry.jsonl`, oldest first."""
    return [e for e in EventLog(Path(job_dir) / REGISTRY).read(required=("job_id", "run_dir", "folder"))
            if e.get("event") == "submitted"]


def record_submission(job_dir: str | os.PathLike, entry: Mapping[str, Any], group: str | None = None) -> None:
    """Append one submission; a new registry is readable by `group` (the cluster config's) like the runs."""
    EventLog(Path(job_dir) / REGISTRY, group_readable=group is not None).write("submitted", **entry)


def run_name(record: Mapping[str, Any]) -> str:
    """The run folder relative to job_dir (e.g. 'tiny-demo' or 'lr-sweep/lr=0.0001')."""
    return record.get("run") or Path(record["run_dir"]).name


def find_record(job_id: str, job_dir: str | os.PathLike) -> dict[str, Any]:
    """The record of job `job_id`, or else the newest job of the run named `job_id` (e.g. 'run1' or
    'lr-sweep/lr=0.0001'); UnknownJobError in one line when there is neither."""
    registry = read_registry(job_dir)
    records = [r for r in registry if r["job_id"] == job_id] or [r for r in registry if run_name(r) == job_id]
    if records:
        return records[-1]
    where = Path(job_dir) / REGISTRY
    if not registry:
        raise UnknownJobError(f"no job {job_id}: {where} lists no runs; "
                              "pass the job_dir the job was submitted with "
                              "(--job-dir or TAEHV_JOB_DIR)")
    known = ", ".join(f"{r['job_id']} ({run_name(r)})" for r in registry[-5:])
    raise UnknownJobError(f"no job or run {job_id} in {where} (latest: {known}); "
                          "check the id or run name, or pass "
                          "the job_dir it was submitted with")
