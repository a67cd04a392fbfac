"""`taehv status` at a lab's scale: thousands of runs in one job_dir, a run with a million metrics lines.

    python3 bench/status_scale.py [--runs 100,1000,10000] [--lines 1000,100000,1000000] [--rounds 3]
                                  [--work DIR] [--out FILE] [--smoke]

One real run first: `taehv submit --local` of configs/train/tiny.yaml for 2 steps. Its folder and its
registry line are then copied to make a job_dir of as many runs as the largest --runs (each a run folder
of the real run's small files, its own job id and name; the checkpoint's weights are left out, its
pointer and meta kept), the newest of them a long run whose metrics.jsonl holds the largest --lines
lines (the real run's rows, one per step, a validation row every 1000) and whose events, checkpoint and
recorded total say so. A smaller size is the newest lines of the same registry, and a shorter run the
first lines of the same metrics file.

Each command is a fresh process, `python -m taehv_slurm status ...` as a user's `taehv status` is:
`status` (the last 20 runs), `status RUN` (the long run, by name) and `status --all`; per size, the
median and fastest wall seconds of --rounds runs and the peak memory (max RSS) of the process. Then
`JobHandle.metrics()` of the long run at 300,000 lines, --rounds times (each in its own process, pandas
imported first as in a notebook: seconds, rows, peak memory). `sizes`: the mean bytes of a registry line and
of a metrics line (the job_dir's size at any --runs and --lines follows).
The machine's load average is recorded before and after. --smoke: 20 and 50 runs, 2,000 lines, one
round (the test suite runs it). JSON under bench/results/ (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import code_version, write_results  # noqa: E402
from taehv_slurm.common.runfolder import (  # noqa: E402
    ATTEMPTS,
    EVENTS,
    METRICS,
    SUBMITIT,
    EventLog,
    JobDir,
    RunFolder,
)

LONG = "long-run"  # the run with the long metrics file (the newest in the registry)
METRICS_ROWS_FOR_FRAME = 300_000  # JobHandle.metrics()'s goal: this many rows in <= 1.5 s


def real_run(work: Path) -> tuple[dict[str, Any], Path]:
    """A finished 2-step tiny run on the local backend: (its registry record, its run folder)."""
    job_dir = work / "real"
    done = subprocess.run([sys.executable, "-m", "taehv_slurm", "submit", "--local", "--train",
                           "configs/train/tiny.yaml", "--set", "steps=2", "--name", "tiny",
                           "--set", f"job_dir={job_dir}"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    if done.returncode:
        sys.exit(f"the real run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    record = EventLog(JobDir(job_dir).registry).read()[-1]
    return record, JobDir(job_dir).run("tiny").path


def copy_run(real: Path, record: dict[str, Any], job_dir: Path, name: str, job_id: str,
             submitted_at: float) -> dict[str, Any]:
    """The real run's small files under `job_dir/name` as job `job_id`; returns its registry record."""
    source, run = RunFolder(real), JobDir(job_dir).run(name)
    folder = run.submitit
    folder.mkdir(parents=True)
    for file in (EVENTS, METRICS, ATTEMPTS):
        shutil.copyfile(source.path / file, run.path / file)
    run.checkpoints.mkdir()
    latest = (source.checkpoints / "latest").read_text().strip()
    (run.checkpoints / latest).mkdir()
    shutil.copyfile(source.checkpoints / latest / "meta.json", run.checkpoints / latest / "meta.json")
    (run.checkpoints / "latest").write_text(latest + "\n")
    old_id = record["job_id"]
    state = json.loads((source.submitit / f"{old_id}_local.json").read_text())
    (folder / f"{job_id}_local.json").write_text(json.dumps({**state, "job_id": job_id}))
    return {**record, "job_id": job_id, "run": name, "folder_rel": f"{name}/{SUBMITIT}",
            "run_dir": str(run.path), "folder": str(folder), "submitted_at": submitted_at}


def long_metrics(real: Path, lines: int, start: float, path: Path) -> None:
    """`lines` metrics lines from the real run's train and validation rows: one per step, 0.2 s apart."""
    rows = RunFolder(real).metrics().read()
    train = next(r for r in rows if "loss" in r)
    val = next((r for r in rows if "val_loss" in r), None)
    with path.open("w") as f:
        step, written = 0, 0
        while written < lines:
            step += 1
            f.write(json.dumps({**train, "step": step, "time": start + 0.2 * step}) + "\n")
            written += 1
            if val is not None and step % 1000 == 0 and written < lines:
                f.write(json.dumps({**val, "step": step, "time": start + 0.2 * step + 0.01}) + "\n")
                written += 1


def make_job_dir(work: Path, runs: int, lines: list[int]) -> tuple[Path, dict[int, Path]]:
    """The job_dir (registry of `runs` runs, the newest the long run) and a metrics file per --lines."""
    record, real = real_run(work)
    job_dir = work / "runs"
    start = time.time() - 86400 * 30
    records = [copy_run(real, record, job_dir, f"run{i:05d}", f"{100000 + i}-bench", start + i)
               for i in range(runs - 1)]
    longest = max(lines)
    long = copy_run(real, record, job_dir, LONG, f"{100000 + runs - 1}-bench", start + runs)
    long["train"] = {**long.get("train", {}), "steps": longest}
    long["plan"] = {**long.get("plan", {}), "total_steps": longest}
    run = JobDir(job_dir).run(LONG)
    events = RunFolder(real).events().read()
    began = start + runs + 1
    for event in events:  # one attempt that trained every step, then finished
        event["time"] = began + 2 + (0.2 * longest if event["event"] in ("finished", "checkpoint") else 0)
        if event["event"] == "start":
            event["began"] = began
        if event["event"] in ("finished", "checkpoint"):
            event["step"] = longest
    run.events().path.write_text("".join(json.dumps(e) + "\n" for e in events))
    checkpoints = run.checkpoints
    (checkpoints / (checkpoints / "latest").read_text().strip()).rename(checkpoints / f"step_{longest:08d}")
    (checkpoints / "latest").write_text(f"step_{longest:08d}\n")
    files = {}
    for count in sorted(lines):
        files[count] = work / f"metrics_{count}.jsonl"
        long_metrics(real, count, began + 2, files[count])
    (work / "registry_all.jsonl").write_text("".join(json.dumps({"event": "submitted", **r}) + "\n"
                                                     for r in [*records, long]))
    return job_dir, files


def use(job_dir: Path, work: Path, runs: int, metrics: Path) -> None:
    """Point the job_dir at its newest `runs` runs and the long run at the metrics file `metrics`."""
    lines = (work / "registry_all.jsonl").read_text().splitlines(keepends=True)
    JobDir(job_dir).registry.write_text("".join(lines[-runs:]))
    target = JobDir(job_dir).run(LONG).metrics().path
    target.unlink(missing_ok=True)
    os.link(metrics, target)


def line_sizes(registry: Path, metrics: Path) -> dict[str, float]:
    """Mean bytes of a registry line and of a metrics line of the long run, as built."""
    def mean(path: Path) -> float:
        with path.open("rb") as f:
            return round(path.stat().st_size / sum(1 for _ in f), 1)

    return {"registry_line_bytes": mean(registry), "metrics_line_bytes": mean(metrics)}


# Runs the command in this process, then reports its peak memory: VmHWM, which starts again at exec (the
# rusage of a child also counts the memory of the process that forked it, this benchmark's).
PEAK = ("import atexit, runpy, sys\n"
        "atexit.register(lambda: print('peak_kb', [line.split()[1] for line in open('/proc/self/status')\n"
        "                                          if line.startswith('VmHWM')][0], file=sys.stderr))\n"
        "sys.argv = ['taehv', *sys.argv[1:]]\n"
        "runpy.run_module('taehv_slurm', run_name='__main__')\n")


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, peak memory in MB) of one `taehv` command in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"taehv {' '.join(argv)} failed: {done.stderr[-2000:]}")
    return seconds, int(done.stderr.rsplit("peak_kb", 1)[1].split()[0]) / 1024


def measure(job_dir: Path, rounds: int) -> list[dict[str, Any]]:
    taehv = ["status", "--job-dir", str(job_dir)]
    commands = {"taehv status": taehv, "taehv status RUN": [*taehv, LONG],
                "taehv status --all": [*taehv, "--all"]}
    rows = []
    for label, argv in commands.items():
        timed(argv)  # once untimed: the page cache is warm for every round
        runs = [timed(argv) for _ in range(rounds)]
        seconds = [s for s, _ in runs]
        rows.append({"command": label, "median_s": round(statistics.median(seconds), 3),
                     "min_s": round(min(seconds), 3), "max_rss_mb": round(max(m for _, m in runs), 1),
                     "seconds": [round(s, 3) for s in seconds]})
    return rows


def frame_time(job_dir: Path) -> dict[str, Any]:
    """JobHandle.metrics() of the long run, in its own process, pandas already imported (as in a notebook)."""
    code = ("import json, sys, time\nimport pandas\nfrom taehv_slurm.handle import JobHandle\n"
            "h = JobHandle.attach(sys.argv[1], sys.argv[2])\nstart = time.perf_counter()\n"
            "frame = h.metrics()\nseconds = time.perf_counter() - start\n"
            "peak = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0]\n"
            "print(json.dumps({'seconds': round(seconds, 3), 'rows': len(frame), "
            "'max_rss_mb': round(int(peak) / 1024, 1)}))\n")
    done = subprocess.run([sys.executable, "-c", code, LONG, str(job_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    if done.returncode:
        sys.exit(f"JobHandle.metrics() failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="100,1000,10000", help="registry sizes (runs in the job_dir)")
    p.add_argument("--lines", default="1000,100000,1000000", help="the long run's metrics lines")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=Path, help="where to build the job_dir (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="20 and 50 runs, 2,000 lines, one round")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.runs, args.lines, args.rounds = "20,50", "2000", 1
    runs = sorted(int(n) for n in args.runs.split(","))
    lines = sorted(int(n) for n in args.lines.split(","))
    frame_lines = [n for n in (METRICS_ROWS_FOR_FRAME,) if not args.smoke] or lines[:1]
    os.environ["PYTHONPATH"] = str(REPO)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="status-scale-", dir=args.work) as tmp:
        work = Path(tmp)
        job_dir, files = make_job_dir(work, max(runs), sorted({*lines, *frame_lines}))
        sizes = line_sizes(work / "registry_all.jsonl", files[max(lines)])
        rows = []
        for count in runs:
            for line_count in lines:
                use(job_dir, work, count, files[line_count])
                for row in measure(job_dir, args.rounds):
                    rows.append({"runs": count, "metrics_lines": line_count, **row})
                    print(f"{count:>6} runs  {line_count:>8} lines  {row['command']:<20} "
                          f"median {row['median_s']:.3f} s  fastest {row['min_s']:.3f} s  "
                          f"{row['max_rss_mb']:.0f} MB", flush=True)
        use(job_dir, work, max(runs), files[frame_lines[0]])
        times = [frame_time(job_dir) for _ in range(args.rounds)]
        frame = {"metrics_lines": frame_lines[0], "rows": times[0]["rows"],
                 "seconds": statistics.median(t["seconds"] for t in times),
                 "min_s": min(t["seconds"] for t in times), "max_rss_mb": max(t["max_rss_mb"] for t in times),
                 "all_seconds": [t["seconds"] for t in times]}
        print(f"JobHandle.metrics() of {frame['rows']} rows: median {frame['seconds']:.3f} s, "
              f"fastest {frame['min_s']:.3f} s, {frame['max_rss_mb']:.0f} MB")
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": platform.processor() or platform.machine() or "cpu", "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": importlib.metadata.version("torch"),
            **code_version(), "rounds": args.rounds, "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()]}
    write_results(args.out, "status_scale_smoke" if args.smoke else "status_scale",
                  {"info": info, "sizes": sizes, "rows": rows, "metrics_frame": frame})


if __name__ == "__main__":
    main()
