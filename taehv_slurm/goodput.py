"""Goodput: how much of what a run was allocated went into training that was kept.

Per attempt of a job — its first run, each requeue, and each restart of its ranks inside the allocation it
holds (taehv_slurm.runtime.restart) — from the run's own files and Slurm's accounting:

- allocated node-seconds: sacct's Elapsed × NNodes of that allocation (where the site keeps accounting;
  else the attempt's span in the run's events × nodes), shared among the attempts inside it by their spans and
  the nodes held in each (a restart gives the nodes it left out back: `nodes_held` in its event);
- time in the queue: from the allocation's submission (or requeue) to its start, Slurm's own Submit and
  Start (where there is accounting; else from the requeue event to the next attempt's start);
- restart: from the fault found (hang verdict, kill, failure) to the restarted ranks' start, inside the
  allocation;
- time to first step: from the rank's process start (`began` in its `start` event) to its first finished
  step (`first_step`), and the part of it before the training loop began (`start_up_s`: imports,
  rendezvous, building the model, restore); the rest is the first step itself, its compilation included;
- steps kept: from the step it resumed at to the step the next attempt resumed from (the last one: the
  run's final checkpoint), and productive seconds = steps kept × its seconds per step (the run's metrics);
- work lost: steps trained past the step that was kept (what an interruption threw away), in steps and
  seconds;
- time in saves (`checkpoint` events);
- and the effective training time ratio, ETTR = productive / allocated.

`attempt_rows` and `run_totals` compute it on plain rows (what `taehv status` shows needs no pandas);
`goodput_frame` is the same as a DataFrame.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

# What ends an attempt, as the run records it (the first one in the attempt's window).
ENDS = ("requeue", "requeue_failed", "finished", "failure", "killed", "hang", "cancelled", "stopped",
        "exited_for_restart", "step_ended", "restart")
COLUMNS = ["attempt", "launch", "began", "ended", "end", "nodes", "allocated_node_s", "queue_s", "restart_s",
           "time_to_first_step_s", "start_up_s", "start_step", "kept_until", "steps_kept", "step_s",
           "productive_node_s", "lost_steps", "lost_s", "save_s", "ettr"]


def attempt_rows(events: Sequence[Mapping[str, Any]], train_rows: Sequence[Mapping[str, Any]], nodes: int,
                 final_step: int | None, accounting: Sequence[Mapping[str, Any]] = (),
                 ranks_per_node: int | None = None) -> list[dict[str, Any]]:
    """One row per attempt of one job (see the module docstring), `began` and `ended` in epoch seconds.
    `nodes`: the nodes the job holds (spares included); `final_step`: the run's latest checkpoint;
    `accounting`: sacct's records of the job (`sacct.sacct_records`; empty where there are none);
    `ranks_per_node`: productive node-seconds count the nodes an attempt trained on (its world size over
    this), not its spares nor a failed node it left out; None: all `nodes`."""
    starts = [e for e in events if e["event"] == "start"]
    rows = []
    held, allocations = nodes, set()
    for i, start in enumerate(starts):
        later = starts[i + 1] if i + 1 < len(starts) else None
        kept_until = later["step"] if later is not None else (final_step or start["step"])
        trained = (int(start["world_size"]) / ranks_per_node if ranks_per_node and start.get("world_size")
                   else nodes)
        allocation = (start.get("job_id"), start.get("restart_count", 0))
        held = _nodes_held(events, start, held) if allocation in allocations else nodes
        allocations.add(allocation)
        rows.append(_attempt_row(start, later, events, train_rows, held, kept_until, trained))
    _share_allocations(rows, starts, events, accounting)
    _waits(rows, starts, events, accounting)
    # numbered across the run's jobs (a chain of follow-up jobs: each its own restart counts from 0)
    order = list(dict.fromkeys(_allocation_of(start) for start in starts))
    for row, start in zip(rows, starts):
        row["attempt"] = order.index(_allocation_of(start))
    return rows


def _allocation_of(start: Mapping[str, Any]) -> tuple[str, int]:
    """(job id, restart count): the allocation an attempt ran in, as sacct numbers them."""
    return str(start.get("job_id")), int(start.get("restart_count", 0))


def run_totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's allocated and productive node-seconds, seconds lost and ETTR over `attempt_rows`; ETTR is
    None (unknown, not 0) while an attempt has too few log lines to give its seconds per step."""
    allocated = sum(r["allocated_node_s"] for r in rows)
    productive = sum(r["productive_node_s"] or 0 for r in rows)
    known = bool(rows) and all(r["productive_node_s"] is not None for r in rows)
    return {"allocated_node_s": round(float(allocated), 1), "productive_node_s": round(float(productive), 1),
            "lost_s": round(float(sum(r["lost_s"] or 0 for r in rows)), 1),
            "ettr": round(productive / allocated, 4) if allocated and known else None}


def goodput_frame(events: Sequence[Mapping[str, Any]], train_rows: Sequence[Mapping[str, Any]], nodes: int,
                  final_step: int | None, accounting: pd.DataFrame | None = None) -> pd.DataFrame:
    """`attempt_rows` as a DataFrame, `began` and `ended` as UTC timestamps; `frame.attrs` holds the
    `run_totals`. `accounting`: `JobHandle.accounting()` (empty or None where there is none)."""
    records = [] if accounting is None or accounting.empty else accounting.to_dict("records")
    return frame_of(attempt_rows(events, train_rows, nodes, final_step, records))


def frame_of(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """`attempt_rows` as `goodput_frame` gives them: a DataFrame, its `attrs` the `run_totals`."""
    import pandas as pd

    stamped = [{**r, "began": pd.Timestamp(r["began"], unit="s", tz="UTC"),
                "ended": pd.Timestamp(r["ended"], unit="s", tz="UTC")} for r in rows]
    frame = pd.DataFrame(stamped, columns=COLUMNS)
    frame.attrs.update(run_totals(rows))
    return frame


def _attempt_row(start: Mapping[str, Any], later: Mapping[str, Any] | None,
                 events: Sequence[Mapping[str, Any]], train_rows: Sequence[Mapping[str, Any]], nodes: int,
                 kept_until: int, trained_nodes: float) -> dict[str, Any]:
    """The goodput of the attempt that began with `start` and lasted until `later` began (or until now)."""
    began = float(start.get("began") or start["time"])
    following = float(later.get("began") or later["time"]) if later is not None else math.inf
    window = [e for e in events if began <= e["time"] < following]
    # a requeue noted at the next start is what ended it, whatever the attempt recorded first (its node failed
    # while its ranks saved at the SIGTERM, as at a SIGTERM that ends only the job step: `step_ended`)
    ends = sorted((e for e in window if e["event"] in ENDS), key=lambda e: not e.get("noted_at_start"))
    rows_in = [r for r in train_rows if began <= r["time"] < following]
    ended = ends[0]["time"] if ends else max([r["time"] for r in rows_in], default=start["time"])
    reached = max([start["step"], *(int(r["step"]) for r in rows_in),
                   *(int(e["step"]) for e in ends if isinstance(e.get("step"), int))])
    first = [e for e in window if e["event"] == "first_step"]
    step_s = _seconds_per_step([{"step": e["step"], "time": e["time"]} for e in first[:1]] + rows_in)
    steps_kept = max(0, kept_until - start["step"])
    lost = max(0, reached - kept_until)
    node_s = (ended - began) * nodes  # the allocation's own figure replaces it where there is accounting
    productive = (0.0 if not steps_kept else steps_kept * step_s * trained_nodes if step_s is not None
                  else None)
    end = "running"
    if ends:
        end = ends[0]["event"] + (f" ({ends[0]['reason']})" if ends[0].get("reason") else "")
    return {"attempt": int(start.get("restart_count", 0)), "launch": 0, "began": began, "ended": ended,
            "end": end, "nodes": nodes, "queue_s": None, "restart_s": None,
            "allocated_node_s": round(node_s, 1),
            "time_to_first_step_s": round(first[0]["seconds"], 1) if first else None,
            "start_up_s": round(start["time"] - began, 1),
            "start_step": start["step"], "kept_until": kept_until, "steps_kept": steps_kept, "step_s": step_s,
            "productive_node_s": None if productive is None else round(productive, 1), "lost_steps": lost,
            "lost_s": None if step_s is None else round(lost * step_s, 1),
            "save_s": round(sum(float(e.get("seconds") or 0) for e in window
                                if e["event"] == "checkpoint"), 2),
            "ettr": None if productive is None or not node_s else round(productive / node_s, 4)}


def _seconds_per_step(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The attempt's median seconds per step between its log lines and its first finished step (the
    first of them, which holds the start-up and compilation, starts the count)."""
    paces = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:])
             if b["step"] > a["step"]]
    return round(statistics.median(paces), 4) if paces else None


def _nodes_held(events: Sequence[Mapping[str, Any]], start: Mapping[str, Any], before: int) -> int:
    """The nodes an allocation holds after the restart inside it that `start` followed: what its `restart`
    event kept (`nodes_held`, where it gave left-out nodes back), else `before`."""
    restart = next((e for e in reversed(events) if e["event"] == "restart" and e["time"] <= start["time"]),
                   None)
    return int(restart.get("nodes_held") or before) if restart is not None else before


def _allocations(accounting: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], list[Mapping[str, Any]]]:
    """(job id, attempt) → sacct's allocation records of that run of the job (more than one where it
    shrank)."""
    found: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in accounting:
        if "NNodes" in r and "." not in str(r["JobID"]):
            found.setdefault((str(r["JobID"]), int(r["Attempt"])), []).append(r)
    return found


def _share_allocations(rows: list[dict[str, Any]], starts: Sequence[Mapping[str, Any]],
                       events: Sequence[Mapping[str, Any]], accounting: Sequence[Mapping[str, Any]]) -> None:
    """Number the attempts inside one allocation (`launch`) and give them its node-seconds: each from its
    start to the next one's × the nodes held then, the last what is left of the allocation (sacct's Elapsed
    × NNodes summed over its sizes, where there is accounting, and never less than its own span; else its
    own span)."""
    allocations = _allocations(accounting)
    groups: dict[tuple[str, int], list[int]] = {}
    for i, start in enumerate(starts):
        groups.setdefault(_allocation_of(start), []).append(i)
    for allocation, members in groups.items():
        for launch, i in enumerate(members):
            rows[i]["launch"] = launch
        records = allocations.get(allocation)
        for i in members[:-1]:  # held from its start to the next one's: the restart between them included
            rows[i]["allocated_node_s"] = round((rows[i + 1]["began"] - rows[i]["began"]) * rows[i]["nodes"],
                                                1)
        if records:
            last = rows[members[-1]]
            requeue = next((e for e in events if e["event"] == "requeue" and e["time"] >= last["began"]
                            and e.get("job_id") == starts[members[-1]].get("job_id")), None)
            total = _node_seconds(records, requeue["time"] if requeue is not None else None)
            # at least its own span: a running job's Elapsed is sacct's at its answer, and the run's files,
            # read after it (a slow squeue between them), may hold steps trained since
            last["allocated_node_s"] = round(
                max(last["allocated_node_s"], total - sum(rows[i]["allocated_node_s"] for i in members[:-1])),
                1)
        for i in members:
            productive = rows[i]["productive_node_s"]
            rows[i]["ettr"] = (round(productive / rows[i]["allocated_node_s"], 4)
                               if productive is not None and rows[i]["allocated_node_s"] else None)


def _node_seconds(records: Sequence[Mapping[str, Any]], requeued_at: float | None) -> float:
    """Elapsed × NNodes over an allocation's records (one per size). Slurm keeps no record of its own for
    a shrunk job's later runs: once requeued, its last record runs on through the queue and the runs after
    (seen on the testbed), so that one counts only until the requeue (`requeued_at`, epoch seconds)."""
    total = 0.0
    for i, record in enumerate(records):
        seconds = float(record["ElapsedSeconds"])
        started = _epoch(record.get("Start"))
        if i and i == len(records) - 1 and requeued_at is not None and started is not None:
            seconds = min(seconds, max(0.0, requeued_at - started))
        total += seconds * int(record["NNodes"] or 1)
    return total


def _epoch(text: Any) -> float | None:
    """sacct's local time ('2026-11-28T10:00:05') as epoch seconds, None where it is not a time."""
    import datetime

    try:
        return datetime.datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def _waits(rows: list[dict[str, Any]], starts: Sequence[Mapping[str, Any]],
           events: Sequence[Mapping[str, Any]],
           accounting: Sequence[Mapping[str, Any]]) -> None:
    """Each attempt's time in the queue (the first of its allocation) or its restart inside it."""
    allocations = _allocations(accounting)
    restarts = [e for e in events if e["event"] == "restart"]
    for i, row in enumerate(rows):
        if row["launch"]:  # started again inside its allocation: from the fault found to its start
            restart = next((e for e in reversed(restarts) if e["time"] <= row["began"] + 1), None)
            if restart is not None:
                found = float(restart.get("fault_time") or restart["time"])
                row["restart_s"] = round(row["began"] - found, 1)
            continue
        records = allocations.get(_allocation_of(starts[i]))
        queued = _queue_seconds(records[0]) if records else None
        if queued is None and i:  # no accounting: from the requeue that ended the attempt before
            requeue = next((e for e in reversed(events) if e["event"] == "requeue"
                            and e["time"] <= row["began"]), None)
            queued = row["began"] - requeue["time"] if requeue is not None else None
        row["queue_s"] = None if queued is None else round(max(0.0, queued), 1)


def _queue_seconds(record: Mapping[str, Any]) -> float | None:
    """sacct's Start − Submit of an allocation record (Slurm's own times), None where either is unknown."""
    start, submit = _epoch(record.get("Start")), _epoch(record.get("Submit"))
    return None if start is None or submit is None else start - submit


def summary(frame: pd.DataFrame) -> str:
    """'goodput: ETTR 93 % of 0.012 node-h; first step after 8 s (start-up 3 s); 1 interruption(s) lost
    3 step(s) (1 s); saves 0.4 s' — the closing line of a run."""
    if frame.empty:
        return "goodput: no attempt has started yet"
    ettr, hours = frame.attrs.get("ettr"), frame.attrs["allocated_node_s"] / 3600
    parts = [f"goodput: ETTR {100 * ettr:.0f} % of {hours:.3g} node-h" if ettr is not None
             else f"goodput: {hours:.3g} node-h allocated (ETTR unknown: too few log lines)"]
    first = frame.dropna(subset=["time_to_first_step_s"])
    if not first.empty:
        parts.append(f"first step after {first['time_to_first_step_s'].iloc[0]:.0f} s "
                     f"(start-up {first['start_up_s'].iloc[0]:.0f} s)")
    if len(frame) > 1:
        parts.append(f"{len(frame) - 1} interruption(s) lost {int(frame['lost_steps'].sum())} step(s) "
                     f"({frame.attrs['lost_s']:.0f} s)")
    parts.append(f"saves {float(frame['save_s'].sum()):.1f} s")
    return "; ".join(parts)
