"""Tables of several runs at once, each row from its `JobHandle`: their metrics (`runs_frame`, a sweep's
results), their status (`status_frame`, what `taehv status` prints) and Slurm's accounting of every
attempt (`accounting_frame`). The status table (`status_table`) is built without pandas; the frames
import it when called. The states and accounting of all the runs of a table are one question to Slurm
(`asked_once`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from taehv_slurm import jobstates
from taehv_slurm.handle import JobHandle
from taehv_slurm.reports import final_row, memory_bytes, render_rows

if TYPE_CHECKING:
    import pandas as pd


def runs_frame(handles: Sequence[JobHandle | str], columns: Sequence[str] = (), *,
               job_dir: str | os.PathLike | None = None, final: bool = False) -> pd.DataFrame:
    """The metrics of several runs in one DataFrame, with job_id, run and each run's swept values as columns.

    handles: JobHandles, or job ids with `job_dir`. final=True keeps one row per run: its last train row
    (with the last validation values beside it) — a sweep's results table.
    """
    import pandas as pd

    parts = []
    for item in handles:
        handle = item if isinstance(item, JobHandle) else JobHandle.attach(item, job_dir or "runs")
        frame = handle.metrics()
        if final:
            frame = final_row(frame)
        parts.append(frame.assign(job_id=handle.job_id, run=handle.name, **handle.sweep))
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    front = [c for c in ("job_id", "run") if c in frame]
    swept = [k for h in handles if isinstance(h, JobHandle) for k in h.sweep]
    order = list(dict.fromkeys([*front, *swept, *frame.columns]))
    frame = frame[order]
    return frame[[*columns]] if columns else frame


def accounting_frame(handles: Sequence[JobHandle]) -> pd.DataFrame:
    """Slurm's accounting of the runs, one row per run attempt (the first run and each requeue): job id,
    run, attempt, state, exit code, elapsed, start, end, nodes, GPUs (AllocTRES gres/gpu; empty where the
    site does not account GPUs) and the largest step's MaxRSS in GB. Empty for runs without accounting
    (the local backend, a cluster without slurmdbd)."""
    import pandas as pd

    rows = []
    with asked_once(handles):
        frames = [(h, h.accounting()) for h in handles if h.backend.has_accounting]
    for handle, frame in frames:
        if frame.empty:
            continue
        steps = frame[frame["JobID"].str.contains(".", regex=False)]
        for _, alloc in frame[frame["JobID"] == handle.job_id].iterrows():
            mine = steps[steps["Attempt"] == alloc["Attempt"]]
            rss = [memory_bytes(v) for v in mine.get("MaxRSS", []) if v]
            tres = dict(item.split("=", 1) for item in str(alloc.get("AllocTRES", "")).split(",")
                        if "=" in item)
            rows.append({"job_id": handle.job_id, "run": handle.name, "attempt": int(alloc["Attempt"]),
                         "state": alloc["State"], "exit_code": alloc["ExitCode"], "elapsed": alloc["Elapsed"],
                         "elapsed_s": alloc["ElapsedSeconds"], "start": alloc["Start"], "end": alloc["End"],
                         "nodes": int(alloc["NNodes"]),
                         "gpus": int(tres["gres/gpu"]) if "gres/gpu" in tres else None,
                         "max_rss_gb": round(max(rss) / 1e9, 3) if rss else None})
    return pd.DataFrame(rows, columns=["job_id", "run", "attempt", "state", "exit_code", "elapsed",
                                       "elapsed_s",
                                       "start", "end", "nodes", "gpus", "max_rss_gb"])


def status_frame(handles: Sequence[JobHandle]) -> pd.DataFrame:
    """One status row per run (`JobHandle.summary`), swept values as columns, note last."""
    import pandas as pd

    with asked_once(handles):
        rows = [h.summary() for h in handles]
    return pd.DataFrame(rows, columns=_status_columns(rows))


def status_rows(handles: Sequence[JobHandle]) -> list[dict[str, Any]]:
    """`status_frame`'s rows as dicts, every row with every column in its order (None where a run has no
    value), without pandas."""
    with asked_once(handles):
        rows = [h.summary() for h in handles]
    columns = _status_columns(rows)
    return [{c: row.get(c) for c in columns} for row in rows]


def _status_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for row in rows for k in row if k != "note")) + ["note"]


def status_table(handles: Sequence[JobHandle]) -> str:
    """The runs as a left-aligned text table: one row per run, swept values as extra columns, note last."""
    return render_rows(status_rows(handles))


@contextlib.contextmanager
def asked_once(handles: Sequence[JobHandle]) -> Iterator[None]:
    """Inside the block, the handles' states and accounting are the answer to one question for them all,
    asked here (on Slurm: one sacct and one squeue call), however often they are read."""
    with jobstates.held_answers():
        by_backend: dict[type, list[JobHandle]] = {}
        for handle in handles:
            by_backend.setdefault(type(handle.backend), []).append(handle)
        for group in by_backend.values():
            group[0].backend.prefetch([h.job_id for h in group])
        yield
