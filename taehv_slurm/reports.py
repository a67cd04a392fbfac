"""Reports built from a run's files: metrics and registries as pandas DataFrames, text tables, plots,
and the progress display of `JobHandle.wait`. Knows files and records, not jobs (taehv_slurm.runs
builds the tables of several JobHandles). Each function that builds or reads a DataFrame imports pandas
when called, so the commands that only print text (`taehv status` as a table, `taehv submit --dry-run`,
`taehv logs`, `taehv cancel`) never load it: `text_table` and `render_rows` need none.
"""

from __future__ import annotations

import gc
import html
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taehv_slurm.common.changes import config_changes, flatten
from taehv_slurm.common.runfolder import EventLog, RunFolder, parse_line, warn_damaged
from taehv_slurm.registry import read_registry, run_name

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


# Columns first in `metrics()`, in this order (others follow as the trainer wrote them).
METRIC_COLUMNS = ("step", "time", "event", "loss", "psnr", "samples_per_second", "lr", "gpu_memory_gb")
# `taehv status` notes the rank (or the link) that cost a run at least this share of its step time.
SLOW_RANK_NOTE_SHARE = 0.05


# ------------------------------------------------------------------------------------ frames


def metrics_frame(run_dir: str | os.PathLike, requeues: Sequence[Mapping[str, Any]] = ()) -> pd.DataFrame:
    """The metrics of a run folder (+ requeue rows) as a DataFrame; see `JobHandle.metrics`. The lines
    are parsed by orjson (3× the standard library's pace: 300,000 lines in well under a second) into
    columns, with a warning for damaged ones as `EventLog.read` gives."""
    import pandas as pd

    rows = [{k: v for k, v in e.items() if k not in ("event", "failed_at_step")} | {"event": "requeue"}
            for e in requeues]
    collecting = gc.isenabled()
    gc.disable()  # 300,000 new dicts would set off the collector again and again, finding nothing to free
    try:
        frame = pd.DataFrame([*_metrics_rows(RunFolder(run_dir).metrics()), *rows])
    finally:
        if collecting:
            gc.enable()
    if frame.empty:
        return pd.DataFrame(columns=list(METRIC_COLUMNS))
    for column in METRIC_COLUMNS:
        if column not in frame:
            frame[column] = pd.Series(dtype=float)
    frame = frame.sort_values(["step", "time"], kind="stable").reset_index(drop=True)
    frame["step"] = frame["step"].astype(int)
    frame["elapsed_s"] = frame["time"] - frame["time"].min()
    frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
    return frame[[*METRIC_COLUMNS, *[c for c in frame.columns if c not in METRIC_COLUMNS]]]


def _metrics_rows(log: EventLog) -> list[dict[str, Any]]:
    """Every whole line of the run's metrics, each with `event` 'val' (it has a val_* value) or 'train'."""
    import orjson

    with log._open() as f:
        data = f.read() if f is not None else b""
    rows, damaged = [], []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw or raw.isspace():
            continue
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError:  # NaN, huge integers: what only the standard library reads
            row = parse_line(raw)
        if not isinstance(row, dict):
            damaged.append(number)
            continue
        row["event"] = "val" if b'"val_' in raw and any(k.startswith("val_") for k in row) else "train"
        rows.append(row)
    if damaged:
        warn_damaged(log.path, damaged, len(rows))
    return rows


def slow_rank_note(rows: Iterable[Mapping[str, Any]], share: float = SLOW_RANK_NOTE_SHARE) -> str | None:
    """The status note on the rank (or the link) named slow that cost the run most, from the run's metrics'
    rows: the others' wait for it per step, summed over the late windows of each streak that got it named
    (a window or two late by chance count for nobody), where that is at least `share` of the summed step
    times of all windows (step 1's, with the start, left out); else None, as for runs without the timing
    (one rank, a ZeRO engine, `slow_rank_windows: 0`)."""
    windows = [r for r in rows if r.get("late_s") is not None and r.get("arrive_s") is not None
               and r.get("step", 0) > 1]
    lost: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    streak: list[Mapping[str, Any]] = []
    for r in windows:
        key = (r.get("late_rank"), r.get("late_host"))
        same = streak and (streak[0].get("late_rank"), streak[0].get("late_host")) == key
        streak = [*streak, r] if r.get("late") and same else [r] if r.get("late") else []
        if r.get("slow_ranks"):  # named in this window: its streak counts
            lost.setdefault(key, []).extend(streak)
            streak = []
    total = sum(r["arrive_s"] + r["wait_s"] for r in windows)
    if not lost or total <= 0:
        return None
    key = max(lost, key=lambda k: sum(w["late_s"] for w in lost[k]))
    seconds = sum(w["late_s"] for w in lost[key])
    if seconds < share * total:
        return None
    causes = [str(w.get("late_cause")) for w in lost[key]]
    cause = max(causes, key=causes.count)
    rank, host = key
    who = "slow collectives (link)" if rank is None else f"rank {rank} on {host} (cause {cause})"
    return (f"{who} cost {100 * seconds / total:.0f} % of the step time: the others waited for it in "
            f"{len(causes)} log window(s)")


def describe_requeue(requeue: dict[str, Any], killed: str | None = None) -> str:
    """'requeued at step 40 (preempted)', or with `killed`, the detail of the ranks killed that caused it; a
    requeue the job could not record (its node died) says it was Slurm's."""
    if requeue.get("noted_at_start"):
        return (f"requeued at step {requeue['step']} by Slurm ({requeue['reason']}; the job could not "
                "record it)")
    return f"requeued at step {requeue['step']} ({killed or requeue['reason']})"


def describe_restart(restart: dict[str, Any]) -> str:
    """'restarted at step 110 on tb1,tb3 after killed (tb2 left out; 4 → 4 ranks; training again 9 s
    later)'."""
    left = f"{','.join(restart['left_out'])} left out; " if restart.get("left_out") else ""
    again = (f"; training again {restart['seconds_to_first_step']:.0f} s later"
             if restart.get("seconds_to_first_step") is not None else "")
    return (f"restarted at step {restart['step']} on {','.join(restart['nodes'])} after {restart['cause']} "
            f"({left}{restart.get('world_before')} → {restart['world_after']} ranks{again})")


def attempts_frame(attempts: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per attempt (taehv_slurm.runtime.provenance): when and where it ran, the code and versions,
    what changed since the attempt before, and its training config flattened to columns ("optim.lr")."""
    import pandas as pd

    rows, previous = [], None
    for attempt in attempts:
        config = attempt.get("config") or {}
        code = attempt.get("code") or {}
        changed = [c.line() for c in config_changes(previous or {}, config)] if previous and config else []
        rows.append({"job_id": attempt.get("job_id"), "restart": attempt.get("restart"),
                     "time": attempt.get("time"), "step": attempt.get("step"),
                     "hosts": ",".join(attempt.get("hosts") or []), "commit": code.get("commit"),
                     "dirty": code.get("dirty"), "diff_file": code.get("diff_file"),
                     **(attempt.get("versions") or {}), "changed": "; ".join(changed), **flatten(config)})
        previous = config or previous
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
    return frame


def final_row(frame: pd.DataFrame) -> pd.DataFrame:
    import pandas as pd

    train = frame[frame["event"] == "train"]
    if train.empty:
        return train
    row = train.iloc[[-1]].reset_index(drop=True).dropna(axis=1, how="all")
    val = frame[frame["event"] == "val"]
    if not val.empty:
        last = val.iloc[-1]
        extra = {k: last[k] for k in val.columns if k.startswith("val_")}
        row = row.assign(**extra, val_step=int(last["step"]))
    row["requeues"] = int((frame["event"] == "requeue").sum())
    return pd.DataFrame(row)


def registry_frame(job_dir: str | os.PathLike) -> pd.DataFrame:
    """The registry as a table: one row per submitted run (job id, run, when, shape, task, swept values)."""
    import pandas as pd

    rows = []
    for rec in read_registry(job_dir):
        rows.append({"job_id": rec["job_id"], "run": run_name(rec),
                     "submitted": pd.Timestamp(rec.get("submitted_at", 0), unit="s"),
                     "backend": rec.get("backend"), "nodes": rec.get("nodes"),
                     "world_size": rec.get("world_size"),
                     "task": rec.get("task"), "steps": (rec.get("plan") or {}).get("total_steps"),
                     **(rec.get("sweep") or {})})
    return pd.DataFrame(rows)


def memory_bytes(text: str) -> float:
    """sacct's memory text ('541940K', '1.50G', '812M', '1024') as bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def render(frame: pd.DataFrame, fmt: str) -> str:
    """A frame as the CLIs print it: 'table' (aligned text), 'csv', or 'json' (a list of records).
    CSV and JSON keep numbers as numbers; the table shows step and steps as one 'step' cell (12/40)."""
    if fmt == "csv":
        return frame.to_csv(index=False).rstrip("\n")
    if fmt == "json":
        return frame.to_json(orient="records", indent=1, date_format="iso")
    return render_rows(frame.to_dict("records"))


def render_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """`render(frame, 'table')` of the frame's records, without pandas: a text table, step and steps as
    one 'step' cell (12/40)."""
    if rows and {"step", "steps"} <= set(rows[0]):
        rows = [{k: (_progress(row["step"], row["steps"]) if k == "step" else v)
                 for k, v in row.items() if k != "steps"} for row in rows]
    return text_table(rows)


def _progress(step: object, steps: object) -> str | None:
    if _cell(step) == "-":
        return None
    return f"{_cell(step)}/{_cell(steps)}" if _cell(steps) != "-" else _cell(step)


def text_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as a left-aligned text table, '-' for a missing value."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and value != value):  # None, or NaN from a frame
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------- progress


def _in_notebook() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class Progress:
    """wait()'s display: an HTML bar replaced in place in a notebook (no ipywidgets needed), tqdm in a
    terminal, else one plain line per state change and at most one per `every_s` for steps."""

    def __init__(self, label: str, total: int | None, enabled: bool = True, every_s: float = 10.0) -> None:
        self.label, self.total, self.enabled, self.every_s = label, total, enabled, every_s
        self.mode = ("off" if not enabled else "notebook" if _in_notebook()
                     else "tty" if sys.stderr.isatty() else "lines")
        self.began = time.monotonic()
        self.last: tuple[str, int | None, int] | None = None
        self.last_line = 0.0
        self.handle: Any = None
        self.bar: Any = None
        if self.mode == "tty":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="step")

    def text(self, state: str, step: int | None, requeues: int) -> str:
        of = f"/{self.total}" if self.total else ""
        again = f" · requeued {requeues}×" if requeues else ""
        return (f"{self.label}: {state} · step {step if step is not None else '-'}{of}{again} · "
                f"{time.monotonic() - self.began:.0f} s")

    def update(self, state: str, step: int | None, requeues: int) -> None:
        now = (state, step, requeues)
        if self.mode == "off" or now == self.last:
            return
        text = self.text(state, step, requeues)
        if self.mode == "notebook":
            from IPython.display import display

            fraction = min(1.0, (step or 0) / self.total) if self.total else 0.0
            markup = (f'<div style="font-family:monospace"><progress value="{fraction:.3f}" max="1" '
                      f'style="width:18em;vertical-align:middle"></progress> '
                      f'{html.escape(text, quote=False)}</div>')
            data = {"text/plain": text, "text/html": markup}
            if self.handle is None:
                self.handle = display(data, raw=True, display_id=True)
            else:
                self.handle.update(data, raw=True)
        elif self.mode == "tty":
            self.bar.n = step or 0
            self.bar.set_postfix_str(f"{state}{f', requeued {requeues}×' if requeues else ''}", refresh=True)
        else:
            state_changed = self.last is None or self.last[0] != state or self.last[2] != requeues
            if state_changed or time.monotonic() - self.last_line >= self.every_s:
                print(text, flush=True)
                self.last_line = time.monotonic()
            else:
                return  # keep self.last so the next step change is compared with what was printed
        self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------- plotting


# (train column, validation column, panel title) of each panel of `plot_metrics`
_PANELS = (("loss", "val_loss", "loss"), ("psnr", "val_psnr", "PSNR (dB)"),
           ("samples_per_second", None, "throughput (clips/s)"))


def plot_metrics(frames: Mapping[str, pd.DataFrame], path: str | os.PathLike | None = None,
                 title: str | None = None) -> Figure:
    """One figure of loss, PSNR and samples/s against step for one or more runs (label → metrics frame).

    Training values are lines, validation values circles, requeues dashed vertical lines (red for one
    run, else in the run's colour); one legend below the panels.
    """
    import matplotlib

    if path is not None and "matplotlib.pyplot" not in sys.modules and not _in_notebook():
        matplotlib.use("Agg")  # saving from a script or CI: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    single = len(frames) == 1
    legend: dict[str, Line2D] = {}  # runs first, then the marker kinds
    kinds: dict[str, Line2D] = {}
    for i, (label, frame) in enumerate(frames.items()):
        color = colors[i % len(colors)]
        if frame.empty:
            continue
        legend["train" if single else str(label)] = Line2D([], [], color=color, linewidth=1.5)
        kinds.update(_plot_run(axes, frame, color, single))
    for ax, (_, _, name) in zip(axes, _PANELS):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    legend.update(kinds)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07 if legend else 0, 1, 1))
    if legend:
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), frameon=False,
                   fontsize=9)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _plot_run(axes: Any, frame: pd.DataFrame, color: str, single: bool) -> dict[str, Any]:
    """One run's lines, validation circles and requeue marks on the panels; the legend entries it adds."""
    from matplotlib.lines import Line2D

    train, val = frame[frame["event"] == "train"], frame[frame["event"] == "val"]
    for ax, (column, val_column, _) in zip(axes, _PANELS):
        if column in train and train[column].notna().any():
            data = train[["step", column]].dropna()
            ax.plot(data["step"], data[column], color=color, linewidth=1.5)
        if val_column and val_column in val and val[val_column].notna().any():
            data = val[["step", val_column]].dropna()
            ax.plot(data["step"], data[val_column], "o", color=color, markersize=7, markerfacecolor="white",
                    markeredgewidth=1.5)
    kinds: dict[str, Any] = {}
    if "val_loss" in val or "val_psnr" in val:
        kinds["validation"] = Line2D([], [], marker="o", linestyle="", markerfacecolor="white",
                                     markeredgewidth=1.5, color=color if single else "0.3")
    mark = "tab:red" if single else color
    requeues = frame[frame["event"] == "requeue"]
    for step in requeues["step"]:
        for ax in axes:
            ax.axvline(step, color=mark, linestyle="--", linewidth=1.2, alpha=0.9)
    if not requeues.empty:
        reasons = requeues["reason"] if "reason" in requeues else ["?"] * len(requeues)
        what = ", ".join(f"{r} at step {int(s)}" for r, s in zip(reasons, requeues["step"]))
        kinds[f"requeue ({what})" if single else "requeue"] = Line2D(
            [], [], color=mark if single else "0.3", linestyle="--", linewidth=1.2)
    return kinds
