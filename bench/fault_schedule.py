"""One fault schedule, inflicted from outside on three runs side by side: restarts inside the allocation
(one spare node held, or shrinking to one node) against requeues (restart_in_allocation off), each run's
ETTR from `taehv status --goodput`.

    . .testbed/env.sh       # 3 nodes or more: python -m tests.slurm_testbed start --nodes 3
    python bench/fault_schedule.py [--minutes 22] [--out bench/results/]

Every run trains the tiny config (32×32 clips, no teacher) on 2 nodes × 1 rank. The schedule, in minutes
after all train: a preemption (`scontrol requeue`) at 4, every rank of the second node SIGKILLed at 9, one
rank SIGSTOPped at 14 (the hang threshold: hang_floor_s 30 s), a rank slowed (stopped 0.3 s of every 0.6 s)
for a minute at 18; all are cancelled at --minutes. Per run: ETTR, node-seconds allocated and productive,
and what the faults cost: work lost, time in the queue (this testbed's queue is idle: a requeue waits ~10 s
here, on a busy cluster the wait is the queue's; bench/goodput_model.py takes it as an input), restarts inside
the allocation, time to the first step again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import code_version, write_results  # noqa: E402
from bench.faults import slowed_down  # noqa: E402
from taehv_slurm.common.runfolder import RunFolder  # noqa: E402

TRAIN = {"steps": 1_000_000, "teacher.kind": "none", "data.height": 32, "data.width": 32,
         "intervals.log_every": 5, "intervals.ckpt_every": 20, "intervals.val_every": 1_000_000}
CLUSTER = {"nodes": 2, "gpus_per_node": 1, "time_min": 120, "hang_floor_s": 30, "heartbeat_s": 3}
# restarts inside the allocation with a spare node held, or shrinking to one node; against requeues
RUNS = {"spare": {"spare_nodes": 1}, "shrink": {"min_nodes": 1},
        "requeue": {"restart_in_allocation": "false"}}
SCHEDULE = ((4, "preempt"), (9, "kill_node"), (14, "stop_rank"), (18, "slow_rank"))


def taehv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "taehv_slurm", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


def submit(name: str, job_dir: Path, extra: dict[str, Any]) -> str:
    sets = {**{k: v for k, v in CLUSTER.items() if k not in ("nodes", "gpus_per_node")}, **TRAIN, **extra,
            "job_dir": job_dir}
    done = taehv("submit", "--cluster", "configs/cluster/testbed.yaml", "--nodes", str(CLUSTER["nodes"]),
                 "--gpus-per-node", str(CLUSTER["gpus_per_node"]), "--train", "configs/train/tiny.yaml",
                 "--name", name, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    if done.returncode:
        sys.exit(f"error: submitting {name} failed: {done.stderr.strip() or done.stdout[-500:]}")
    return re.search(r"submitted job (\S+?):", done.stdout)[1]


def ranks(run_dir: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(RunFolder(run_dir).ranks.glob("*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    latest = max((r.get("launch", 0), r.get("restart", 0)) for r in found) if found else None
    return [r for r in found
            if (r.get("launch", 0), r.get("restart", 0)) == latest and r.get("exit_code") is None]


def job_of(run_dir: Path) -> str:
    starts = [e for e in RunFolder(run_dir).events().read() if e.get("event") == "start"]
    return starts[-1]["job_id"]


def inflict(fault: str, run_dir: Path) -> str:
    """One fault on a run, as a cluster inflicts it; what was done, in words."""
    live = ranks(run_dir)
    if not live:
        return "no live rank"
    victim = max(live, key=lambda r: r["rank"])
    if fault == "preempt":
        subprocess.run(["scontrol", "requeue", job_of(run_dir)], check=False)
        return "scontrol requeue"
    if fault == "kill_node":
        for r in (r for r in live if r["host"] == victim["host"]):
            os.kill(r["pid"], signal.SIGKILL)
        return f"SIGKILL every rank on {victim['host']}"
    if fault == "stop_rank":
        os.kill(victim["pid"], signal.SIGSTOP)
        return f"SIGSTOP rank {victim['rank']} on {victim['host']}"
    with slowed_down(victim["pid"], 0.3, 0.3):  # slow_rank: stopped 0.3 s of every 0.6 s for a minute
        time.sleep(60)
    return f"rank {victim['rank']} on {victim['host']} stopped half of the time for 60 s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=22.0)
    p.add_argument("--work", type=Path, default=Path("/tmp/taehv-fault-schedule"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    job_dir = args.work / f"runs-{time.strftime('%H%M%S')}"
    jobs = {name: submit(name, job_dir, extra) for name, extra in RUNS.items()}
    runs = {name: job_dir / name for name in RUNS}
    while not all(any(e.get("event") == "first_step" for e in RunFolder(d).events().read())
                  for d in runs.values()):
        time.sleep(2)
    began, done = time.monotonic(), []
    for minute, fault in SCHEDULE:
        time.sleep(max(0.0, began + 60 * minute - time.monotonic()))
        for name, run_dir in runs.items():
            what = inflict(fault, run_dir)
            done.append({"minute": minute, "run": name, "fault": fault, "what": what})
            print(f"{minute:>4} min  {name:<8} {what}", flush=True)
    time.sleep(max(0.0, began + 60 * args.minutes - time.monotonic()))
    for job in jobs.values():
        taehv("cancel", job, "--job-dir", str(job_dir))
    time.sleep(20)  # the cancels saved; accounting settles
    results = {}
    for name, job in jobs.items():
        out = taehv("status", job, "--job-dir", str(job_dir), "--goodput", "--format", "json")
        if out.returncode:
            sys.exit(f"error: taehv status {job} failed: {out.stderr.strip()}")
        rows = json.loads(out.stdout)
        results[name] = {"job_id": job, "rows": rows, **totals(rows)}
        print(f"{name}: {json.dumps(totals(rows))}", flush=True)
    write_results(args.out, "fault_schedule", {"info": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                        "device": "cpu", **code_version()},
                                               "minutes": args.minutes, "schedule": done, "runs": results})


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """ETTR and where the rest went, summed over a run's attempts."""
    def total(key: str) -> float:
        return round(sum(float(r.get(key) or 0) for r in rows), 1)

    allocated, productive = total("allocated_node_s"), total("productive_node_s")
    return {"ettr": round(productive / allocated, 4) if allocated else None, "allocated_node_s": allocated,
            "productive_node_s": productive, "lost_s": total("lost_s"), "queue_s": total("queue_s"),
            "restart_s": total("restart_s"), "first_step_s": total("time_to_first_step_s"),
            "attempts": len(rows)}


if __name__ == "__main__":
    main()
