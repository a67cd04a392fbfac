"""When a job must not start, or not be requeued again: decided from the run's own events
(`RunFolder.events`).

- the requeue limit: at most `max_requeues` starts of one job;
- no progress: more than `max_requeues_without_progress` starts in a row that began at the same step and
  ended without a later checkpoint (a preemption does not count);
- a failure that repeats: the attempt before this one ended with the same failure (the same error,
  numbers aside; a rank killed by the same signal at the same step, as an out-of-memory kill repeats),
  so a third attempt would too: stop after two. A node fault — a rank killed from outside, a lost
  connection, a hardware error — is retried elsewhere instead (the failed node is excluded), unless it
  repeats at the same step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Errors that say the node or the network failed, not the code: a restart elsewhere can succeed.
COMMUNICATION_MARKS = ("NCCL", "DistBackendError", "DistNetworkError", "Connection reset by peer",
                       "Connection closed by peer", "Broken pipe", "ProcessGroupGloo", "Socket Timeout")
HARDWARE_MARKS = ("uncorrectable ECC", "ECC error", "Xid", "unspecified launch failure", "GPU is lost",
                  "CUDA error: an illegal instruction", "NVLink")
FAILURE_EVENTS = ("failure", "killed", "hang")


def is_hardware_fault(error: str) -> bool:
    """A failure that names the node's hardware (a GPU error): that node is excluded from the next attempt."""
    return any(mark.lower() in error.lower() for mark in HARDWARE_MARKS)


def is_communication_error(error: str) -> bool:
    """A failure that says a peer or the network went away (often the echo of a peer that died)."""
    return any(mark.lower() in error.lower() for mark in COMMUNICATION_MARKS)


def leaves_its_node_out(failure: dict[str, Any]) -> bool:
    """A failure that names its node: a GPU's hardware error, or the node's own disk full or read-only
    (`node_fault`, taehv_slurm.runtime.checkpoint.Checkpointer.on_a_nodes_disk). Its node is excluded from
    the next attempt."""
    return bool(failure.get("node_fault")) or is_hardware_fault(str(failure.get("error") or ""))


def is_node_fault(event: dict[str, Any]) -> bool:
    error = str(event.get("error") or "")
    return event["event"] in ("killed", "hang") or leaves_its_node_out(event) or is_communication_error(error)


def signature(event: dict[str, Any]) -> str:
    """What makes two failures the same: the error with its numbers blanked (a node fault: also the step)."""
    if event["event"] == "killed":
        return f"killed by signal {event.get('signal')} at step {event.get('step')}"
    if event["event"] == "hang":
        return f"hang in {event.get('section')} at step {event.get('step')}"
    text = re.sub(r"\d+", "#", str(event.get("error") or ""))
    return f"{text} at step {event.get('step')}" if is_node_fault(event) else text


def first_failures(history: Sequence[dict[str, Any]], job_id: str) -> dict[int, dict[str, Any]]:
    """The first failure of each attempt (segment) of job `job_id`: the cause; later ones are its echo."""
    found: dict[int, dict[str, Any]] = {}
    for event in history:
        if (event["event"] in FAILURE_EVENTS and event.get("job_id") == job_id
                and isinstance(event.get("segment"), int)):
            found.setdefault(event["segment"], event)
    return found


@dataclass(frozen=True)
class Guards:
    max_requeues: int = 20
    max_requeues_without_progress: int = 2

    def refuse_reason(self, history: Sequence[dict[str, Any]], job_id: str, saved_step: int) -> str | None:
        """Why job `job_id` must not start (or be requeued) again, or None. `saved_step`: the run's
        latest checkpoint."""
        stopped = [e for e in history if e["event"] == "stopped" and e.get("job_id") == job_id]
        if stopped:
            return stopped[-1]["reason"]
        starts = [e for e in history if e["event"] == "start" and e.get("job_id", job_id) == job_id]
        if len(starts) > self.max_requeues:
            return (f"requeue limit reached: the job started {len(starts)} times "
                    f"(max_requeues={self.max_requeues})")
        return self.no_progress(history, job_id, saved_step) or self.repeats(history, job_id)

    def no_progress(self, history: Sequence[dict[str, Any]], job_id: str, now: int) -> str | None:
        """More than `max_requeues_without_progress` starts in a row of this job began at step `now` and
        ended (failure, timeout, a task that could not save) without a later checkpoint; a segment that
        Slurm preempted does not count."""
        stuck = 0
        for start in reversed([e for e in history if e["event"] == "start" and e.get("job_id") == job_id]):
            ends = [e for e in history if e.get("segment") == start["segment"] and e["event"] == "requeue"]
            if start["step"] != now or any(e["reason"] == "preempted" for e in ends):
                break
            stuck += 1
        if stuck <= self.max_requeues_without_progress:
            return None
        errors = [e for e in history if e["event"] in FAILURE_EVENTS]
        last = f"; last error: {errors[-1].get('error') or errors[-1].get('detail')}" if errors else ""
        return (f"no progress: {stuck} starts in a row began at step {now} and ended without saving a later "
                f"step (max_requeues_without_progress={self.max_requeues_without_progress}){last}")

    @staticmethod
    def repeats(history: Sequence[dict[str, Any]], job_id: str) -> str | None:
        """The last two attempts of the job ended with the same failure: it will repeat."""
        failures = first_failures(history, job_id)
        if len(failures) < 2:
            return None
        last_segment = max(failures)
        last, before = failures[last_segment], failures.get(last_segment - 1)
        if before is None or signature(last) != signature(before):
            return None
        what = last.get("error") or last.get("detail") or signature(last)
        return (f"the same failure ended two attempts in a row ({what}), so another would end the same way: "
                "fix its cause, then submit the run again")
