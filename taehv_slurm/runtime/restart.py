"""What follows a job step that ended in a fault, decided in the batch script once every rank of it ended.

Where the cluster config keeps `restart_in_allocation` on, a fault does not send the job back to the queue:
the ranks start again inside the allocation the job holds (taehv_slurm.runtime.steps) —
  - after a failure the code may not repeat (a lost connection, a stray signal): on the same nodes;
  - after a hang, a rank killed from outside, or a hardware error: without that node, a spare node taking
    its place (`spare_nodes`), else on fewer nodes at the same effective batch (`min_nodes`);
from the newest checkpoint, as one more attempt of the same job (same job id; a `restart` event: cause,
nodes left out, world size before and after, when the fault was found). The nodes left out go back to
Slurm (`released`): the job no longer holds them idle. The job is requeued as before when
no usable set of nodes is left or the time limit is too near for a restart to pay off, and stops when the
guards say the failure would repeat. A failure that ends the run (a diverged run, a failure before training
started) ends the job as before.

Which fault ended the step, from the step's events and its ranks' records: a hang verdict (the ranks ended
on purpose after it); else ranks killed from outside — those that went silent first, since the others of
the step may be killed afterwards as collateral — unless a rank ended the step on purpose after its own
failure; else the first failure; else a step every rank left after a signal that was no job event.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taehv_slurm.common.runfolder import EventLog, RunFolder
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.distenv import attempt_of_environ
from taehv_slurm.runtime.guards import leaves_its_node_out
from taehv_slurm.runtime.ranks import killed_ranks, read_ranks
from taehv_slurm.runtime.steps import (
    FOLLOW_UP_EXIT_CODE,
    JOB_ENDING_ENV,
    RESTART_EXIT_CODE,
    allocation_nodes,
    handed_over,
    launch_number,
    placement_path,
    read_placement,
    write_step,
)

if TYPE_CHECKING:
    from taehv_slurm.runtime.requeue import RequeueableTask

JOB_ENDS = ("requeue", "requeue_failed", "cancelled", "stopped")  # the job itself is requeued or ends
FIRST_STEP_GUESS_S = 120.0  # a restart's time to its first step before the run has shown its own
RESTART_MARGIN_S = 60.0  # training a restart must have before the time limit's warning to be worth it


def after_step(task: RequeueableTask, status: int, last_error: str) -> int:
    """The batch script's answer once a step of the ranks ended with srun's `status`: RESTART_EXIT_CODE to
    start the ranks again (their placement written for the script), else the job's exit status."""
    run_dir, (job_id, restart), launch = Path(task.run_dir), attempt_of_environ(), launch_number()
    events = RunFolder(run_dir).events()
    history, records = events.read(), read_ranks(run_dir, job_id, restart, launch)
    since = step_began(history, records, job_id, restart, launch)
    window = [e for e in history if e.get("job_id") == job_id and e.get("time", 0) >= since]
    if handed_over(window):
        return FOLLOW_UP_EXIT_CODE
    if os.environ.get(JOB_ENDING_ENV) == "1":
        return status  # Slurm is ending the job (its SIGTERM reached the script): the ranks' records stand
    if any(e["event"] in (*JOB_ENDS, "finished") for e in window):
        return status  # the ranks settled it with Slurm (a preemption, the time limit, a cancel), or finished
    if status == 0 and not any(e["event"] == "step_ended" for e in window):
        return 0
    starts = [e for e in window if e["event"] == "start"]
    segment = starts[-1]["segment"] if starts else None
    fault = find_fault(task, window, records, status, events, segment, job_id, last_error)
    if fault is None or not starts:
        return status  # nothing a restart can mend: the ranks' own failure stands
    return restart_or_requeue(task, events, run_dir, job_id, restart, launch, segment, records, fault, status)


def step_began(history: list[dict[str, Any]], records: list[dict[str, Any]], job_id: str, restart: int,
               launch: int) -> float:
    """When this job step began: its ranks' first record, else the restart that started it (0: the first)."""
    if records:
        return min(r["started"] for r in records)
    restarts = [e for e in history if e["event"] == "restart" and e.get("job_id") == job_id
                and e.get("restart_count") == restart and e.get("launch") == launch]
    return restarts[-1]["time"] if restarts else 0.0


def find_fault(task: RequeueableTask, window: list[dict[str, Any]], records: list[dict[str, Any]],
               status: int, events: EventLog, segment: int | None, job_id: str,
               last_error: str) -> dict[str, Any] | None:
    """The fault that ended the step: {cause, hosts (to leave out), time, step}; None when it needs no
    restart (a failure the run stops at). Records the ranks killed from outside, as the ranks cannot."""
    hang = next((e for e in window if e["event"] == "hang"), None)
    if hang is not None:
        return {"cause": "hang", "hosts": list(hang.get("hosts") or []), "time": hang["time"],
                "step": hang.get("step")}
    failures = [e for e in window if e["event"] == "failure"]
    ended_on_purpose = any(e.get("ends_step") for e in window)
    killed = first_silent(killed_ranks(records), task.watchdog.interval_s)
    if killed and not ended_on_purpose:
        name, detail, step = task.describe_killed(killed, status)
        hosts = sorted({r["host"] for r in killed})
        events.write("killed", segment=segment, ranks=[r["rank"] for r in killed], hosts=hosts,
                     signal=status - 128 if status > 128 else None, signal_name=name, step=step,
                     detail=detail, job_id=job_id)
        print(f"error: {detail}", flush=True)
        return {"cause": "killed", "hosts": hosts, "time": max(r["time"] for r in killed), "step": step}
    if failures:
        first = next((e for e in failures if e.get("ends_step")), failures[0])
        if first.get("fatal") or not task.requeue_on_failure:
            return None
        hosts = [first["host"]] if leaves_its_node_out(first) and first.get("host") else []
        return {"cause": "failure", "hosts": hosts, "time": first["time"], "step": first.get("step")}
    signalled = next((e for e in window if e["event"] == "step_ended"), None)
    if signalled is not None:
        return {"cause": "signal", "hosts": [], "time": signalled["time"], "step": signalled.get("step")}
    error = last_error or f"the ranks ended with exit code {status} before the task started"
    events.write("failure", segment=segment, rank=None, step=None, job_id=job_id, error=error)
    return None


def first_silent(killed: list[dict[str, Any]], heartbeat_s: float) -> list[dict[str, Any]]:
    """Of the ranks killed from outside, those that went silent first (their records' last refresh within
    two heartbeats of the earliest): the step's other ranks are often killed after them, by its end."""
    if not killed:
        return []
    earliest = min(r["time"] for r in killed)
    return [r for r in killed if r["time"] <= earliest + 2 * heartbeat_s + 1]


def restart_or_requeue(task: RequeueableTask, events: EventLog, run_dir: Path, job_id: str, restart: int,
                       launch: int, segment: int | None, records: list[dict[str, Any]], fault: dict[str, Any],
                       status: int) -> int:
    """Start the ranks again inside the allocation, or requeue, or stop (see the module docstring)."""
    if task.stop_reason(events, run_dir, job_id, segment):
        return status
    history = events.read()
    before = excluded_so_far(history, job_id, restart)
    now = [h for h in (fault["hosts"] if task.exclude_failed_nodes else []) if h not in before]
    folder = os.environ["SUBMITIT_FOLDER"]
    # kept by the batch script's first line; a job queued by older code named it in its pickle
    placement = getattr(task, "placement", None) or read_placement(folder, job_id)
    nodes = placement.choose(allocation_nodes(), before + now) if placement else None
    left, needed = task.backend.seconds_left(job_id), restart_needs_s(task, history)
    if nodes is None or (left is not None and left < needed):
        why = (f"the job's placement ({placement_path(folder, job_id)}) is missing" if placement is None
               else "no usable set of nodes is left in the allocation" if nodes is None
               else f"{left:.0f} s are left before the time limit, a restart needs ~{needed:.0f} s")
        print(f"[taehv] requeueing instead of restarting in the allocation: {why}", flush=True)
        event = task._requeue_or_stop(events, run_dir, job_id, segment, fault["cause"], fault["step"], now,
                                      since=fault["time"])
        return FOLLOW_UP_EXIT_CODE if event == "requeue" and handed_over(events.read()[-1:]) else status
    saved = Checkpointer(RunFolder(run_dir).checkpoints).read_meta()
    tasks_per_node = placement.tasks_per_node
    released = task.backend.release_nodes(job_id, before + now) if before + now else {}
    events.write("restart", segment=segment, cause=fault["cause"], step=saved["step"] if saved else 0,
                 failed_at_step=fault["step"], excluded=before + now, left_out=now, nodes=nodes,
                 nodes_before=sorted({r["host"] for r in records}),
                 world_before=len(records) or None, world_after=len(nodes) * tasks_per_node,
                 fault_time=fault["time"],
                 seconds_lost=round(time.time() - max(saved["saved_at"] if saved else 0.0, fault["time"]), 1),
                 job_id=job_id, restart_count=restart, launch=launch + 1, **released)
    print(f"[taehv] {fault['cause']}: starting the ranks again inside the allocation on {','.join(nodes)}"
          + (f" (left out: {','.join(now)})" if now else "")
          + (f"; {','.join(released['released'])} given back to Slurm" if released.get("released") else "")
          + (f"; could not give the left-out nodes back: {released['release_error']}"
             if released.get("release_error") else ""), flush=True)
    write_step(folder, job_id, placement, nodes)
    return RESTART_EXIT_CODE


def excluded_so_far(history: list[dict[str, Any]], job_id: str, restart: int) -> list[str]:
    """The nodes this allocation's earlier restarts left out."""
    found: list[str] = []
    for e in history:
        if e["event"] == "restart" and e.get("job_id") == job_id and e.get("restart_count") == restart:
            found += [h for h in e.get("excluded") or [] if h not in found]
    return found


def restart_needs_s(task: RequeueableTask, history: list[dict[str, Any]]) -> float:
    """Time a restart needs before the time limit to be worth it: its start to the first step (as the run
    last showed it), the time-limit warning's delay, and a minute of training."""
    firsts = [float(e["seconds"]) for e in history if e["event"] == "first_step" and e.get("seconds")]
    warning = task.grace_s["timeout"] + 10.0  # signal_delay_s
    return (firsts[-1] if firsts else FIRST_STEP_GUESS_S) + warning + RESTART_MARGIN_S
