"""Where `jobs.prepare`'s GPU waits: one rank's whole loop under torch.profiler, each gap in the GPU's
timeline put down to what the rank's main thread was doing during it.

    python bench/prepare_e2e.py --variants defaults-cold     # makes the videos, teacher and prepared folder
    python bench/prepare_timeline.py                          # then this, on the same --work folder

The prepared folder's shards are removed and `PrepareTask` (what every rank of `jobs.prepare` runs, with
the same cluster config: 12 CPUs, compiled teacher, batch 2, the warm compile cache) runs again in this
process under the profiler. Shards after the first count (on a CPU, with bench/prepare_e2e.py --smoke's one
shard, that one: a check that the script runs). Printed and written as JSON: the wall time, the
GPU's busy time (kernels and copies), its idle time split by the innermost labelled region or CPU op on the
main thread at the middle of each gap, and the GPU's busy time per teacher call (to compare with the
isolated call of bench/prepare_throughput.py).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import run_info, write_results  # noqa: E402
from taehv_slurm.common.config import load_cluster  # noqa: E402
from taehv_slurm.trainer import prepare  # noqa: E402
from taehv_slurm.trainer.shards import SHARD_DIR  # noqa: E402
from taehv_slurm.trainer.teacher import Teacher  # noqa: E402

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def labelled(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapper


def label_the_loop() -> None:
    """record_function regions around the rank loop's parts (this process only)."""
    worker = prepare._Worker
    for attr, name in [("_make_shard", "shard"), ("_encode", "encode"), ("_wait_for_writer", "wait_writer"),
                       ("_shards_done", "shards_done"), ("_progress", "progress")]:
        setattr(worker, attr, labelled(f"#{name}", getattr(worker, attr)))
    Teacher.latents = labelled("#teacher", Teacher.latents)
    make_stream = worker._stream

    def stream(self: Any, clips: Any, windows: list[int]) -> Iterator[dict[str, Any]]:
        inner = make_stream(self, clips, windows)
        while True:
            with torch.profiler.record_function("#loader_next"):
                item = next(inner, None)
            if item is None:
                return
            yield item
    worker._stream = stream


def analyse(trace: dict[str, Any]) -> dict[str, Any]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    # the labelled regions on the host (the trace repeats each on the GPU's timeline as gpu_user_annotation)
    regions = [e for e in events if e.get("cat") == "user_annotation"]
    shards = sorted((e for e in regions if e["name"] == "#shard"), key=lambda e: e["ts"])
    if not shards:
        raise SystemExit("error: no shard was made under the profiler")
    main_tid = shards[0]["tid"]
    measured = shards[1:] or shards  # after the first (its batches compile), unless there is one
    t0, t1 = measured[0]["ts"], measured[-1]["ts"] + measured[-1]["dur"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES
                 and e["ts"] + e["dur"] > t0 and e["ts"] < t1)
    busy, gaps, end = 0.0, [], t0
    for start, stop in gpu:
        start, stop = max(start, t0), min(stop, t1)
        if start > end:
            gaps.append((end, start))
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    if end < t1:
        gaps.append((end, t1))
    host = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e["tid"] == main_tid and e.get("cat") in ("cpu_op", "user_annotation")
                   and e["ts"] < t1 and e["ts"] + e["dur"] > t0), key=lambda r: (r[0], -r[1]))

    def where(t: float) -> str:
        chain = [name for start, stop, name in host if start <= t < stop]  # outermost first
        labels = [n for n in chain if n.startswith("#")]
        ops = [n for n in chain if not n.startswith("#")]
        return " > ".join(labels[-2:] + ops[:1]) or "(no region)"

    idle: dict[str, list[float]] = collections.defaultdict(list)
    for start, stop in gaps:
        idle[where((start + stop) / 2)].append(stop - start)
    teacher = [e for e in regions if e["name"] == "#teacher" and t0 <= e["ts"] < t1]
    wall = t1 - t0
    windows = sum(1 for e in regions if e["name"] == "#loader_next" and t0 <= e["ts"] < t1)
    return {
        "wall_s": wall / 1e6, "windows": windows, "clips_per_s": windows / (wall / 1e6),
        "gpu_busy_s": busy / 1e6, "gpu_idle_s": (wall - busy) / 1e6,
        "idle_by_host_region": {k: {"seconds": round(sum(v) / 1e6, 4), "gaps": len(v),
                                    "longest_ms": round(max(v) / 1e3, 2)}
                                for k, v in sorted(idle.items(), key=lambda kv: -sum(kv[1]))},
        "teacher_calls": len(teacher),
        "gpu_busy_ms_per_teacher_call": round(busy / 1e3 / max(1, len(teacher)), 2),
        "teacher_call_host_ms_mean": round(sum(e["dur"] for e in teacher) / max(1, len(teacher)) / 1e3, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/taehv-prepare-e2e", help="bench/prepare_e2e.py's folder")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(args.work)
    prepared = work / "prepared"
    if not (prepared / "index.csv").is_file():
        sys.exit(f"error: no prepared folder under {work}: run bench/prepare_e2e.py first (--smoke on a CPU)")
    shutil.rmtree(prepared / SHARD_DIR, ignore_errors=True)
    cluster = load_cluster(str(work / "one_gpu.yaml"))
    label_the_loop()
    task = prepare.PrepareTask(prepared, runtime=cluster.runtime())
    began = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = task()
    print(f"prepared under the profiler in {time.perf_counter() - began:.0f} s: {result}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        figures = analyse(json.loads(path.read_text()))
    info = run_info(torch.cuda.is_available(), cpus_per_task=cluster.cpus_per_task)
    print(json.dumps(figures, indent=1))
    write_results(args.out, "prepare_timeline", {"info": info, "figures": figures})


if __name__ == "__main__":
    main()
