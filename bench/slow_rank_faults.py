"""Each slow-rank fault inflicted from outside on the last rank of a real run, and what the run named
(docs/failures.md, taehv_slurm/trainer/stragglers.py), through the user's command.

    python bench/slow_rank_faults.py --data /tmp/taehv-e2e/prepared --gpus 4    # GPUs: the shipped config
    python bench/slow_rank_faults.py --cluster configs/cluster/gpu_testbed.yaml --nodes 2 --gpus 1 --synthetic
    python bench/slow_rank_faults.py --smoke --out /tmp/faults.json              # CPU, tiny, 2 ranks

Per fault one `python -m jobs.submit --local` of configs/train/taehv.yaml on --gpus GPUs of this machine
(data.path set; --synthetic: synthetic 128×192 clips, 10-step log windows; --smoke: the tiny config, 2 CPU
ranks, log_every 2); with --cluster, through Slurm on that cluster config instead (the GPU Slurm cluster of
tests/slurm_testbed.py --real-gpus, SLURM_CONF set), --nodes × --gpus ranks. From --fault-step on, the last
rank is slowed for --fault-s seconds (--until-named: until the run names a rank, --fault-s at most):

- host: its process stopped 0.25 s of every 0.5 s (SIGSTOP/SIGCONT; --host-cycle), a starved or throttled
  host;
- data: its loader workers (its child processes) stopped 0.45 s of every 0.5 s (--data-cycle);
- GPU: --gpu-extra-s (0.25) s more device work per step (bench/slower_device, brought in from outside the
  product through the job's PYTHONPATH; from the start);
- none: nothing: no rank may be named.

Per fault: the rank and cause named, after how many log windows (from the fault's start; for GPU from the
first window), the seconds per step lost, and clips/s before and during the fault. JSON under
bench/results/ (or --out). --data is a prepared folder (bench/e2e_throughput.py leaves one in its --work).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import run_info, write_results  # noqa: E402
from bench.faults import children, rank_record, slowed_down, slower_device_env, wait_for  # noqa: E402
from taehv_slurm.common.runfolder import RunFolder  # noqa: E402

FAULTS = ("host", "data", "GPU", "none")
TINY = {"teacher.kind": "none", "data.height": 32, "data.width": 32, "intervals.log_every": 2,
        "data.num_workers": 1, "data.prefetch_factor": 1}
# 10-step log windows on synthetic clips: they keep the loader near its limit, so a slowed one stretches a
# window most (a 25-step window outlasted the whole fault on 2 ranks of an H200)
SYNTHETIC_LOG_EVERY = 10


def cluster_file(work: Path, args: argparse.Namespace, fault: str) -> Path:
    """A local cluster config of --gpus GPUs (--smoke: 2 CPU ranks)."""
    count = ranks(args)
    path = work / f"faults_{fault}.yaml"
    path.write_text(f"backend: local\nnodes: 1\ngpus_per_node: {0 if args.smoke else count}\n"
                    f"tasks_per_node: {count}\ncpus_per_task: {args.cpus}\n"
                    f"device: {'cpu' if args.smoke else 'cuda'}\ntime_min: 600\nsignal_delay_s: 60\n"
                    f"job_dir: {work / 'runs'}\n"
                    + ("torch_threads: 1\n" if args.smoke else ""))
    return path


def log_every(args: argparse.Namespace) -> int | None:
    """Steps per log window: --log-every, else the smoke's or synthetic clips' own; None: the config's."""
    if args.log_every:
        return args.log_every
    if args.smoke:
        return TINY["intervals.log_every"]
    return SYNTHETIC_LOG_EVERY if args.synthetic else None


def submit_argv(fault: str, args: argparse.Namespace, work: Path, name: str) -> list[str]:
    """The user's command for one fault's run: --local on this machine, or through Slurm on --cluster."""
    sets: dict[str, Any] = {"steps": 100_000}
    if args.smoke:
        sets.update(TINY)
    elif args.synthetic:
        sets.update({"data.source": "synthetic", "data.height": 128, "data.width": 192, "data.val_clips": 4})
    else:
        sets["data.path"] = args.data
    if every := log_every(args):
        sets["intervals.log_every"] = every
    if args.cluster:
        sets.update({"job_dir": work / "runs", "cpus_per_task": args.cpus})
        where = ["--cluster", args.cluster, "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus)]
    else:
        where = ["--local", "--cluster", str(cluster_file(work, args, fault))]
    train = REPO / ("configs/train/tiny.yaml" if args.smoke else "configs/train/taehv.yaml")
    return [sys.executable, "-m", "jobs.submit", *where, "--train", str(train), "--name", name,
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


def ranks(args: argparse.Namespace) -> int:
    return 2 if args.smoke else args.nodes * args.gpus


def one_fault(fault: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run with `fault` on its last rank: what was named, when, and what it cost."""
    name = f"faults-{fault.lower()}-{time.strftime('%H%M%S')}"
    log = (work / f"{name}.log").open("w")
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    if fault == "GPU":
        env.update(slower_device_env(ranks(args) - 1, 0.2 if args.smoke else args.gpu_extra_s, path))
    proc = subprocess.Popen(submit_argv(fault, args, work, name), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    run_dir, victim = work / "runs" / name, ranks(args) - 1
    try:
        record = wait_for(lambda: ((r := rank_record(run_dir, victim)).get("step") or 0) >= args.fault_step
                          and r, args.timeout, "the run to reach --fault-step")
        began, before = time.time(), max([r["step"] for r in RunFolder(run_dir).metrics().read()], default=0)
        pids = children(record["pid"]) if fault == "data" else [record["pid"]]
        cycle = {"host": args.host_cycle, "data": args.data_cycle}.get(fault)
        if args.smoke and cycle:
            cycle = {"host": (0.4, 0.2), "data": (0.9, 0.1)}[fault]
        with slowed_down(pids, *cycle) if cycle else contextlib.nullcontext():
            deadline = began + args.fault_s
            while time.time() < deadline and not (args.until_named and named(run_dir)):
                time.sleep(min(1.0, max(0.0, deadline - time.time())))
        ended = time.time()
        wait_for(lambda: [r for r in RunFolder(run_dir).metrics().read() if r.get("time", 0) > ended + 1],
                 args.timeout, "a log window after the fault")
    finally:
        job = re.search(r"submitted job (\S+):", (work / f"{name}.log").read_text())
        if job:
            subprocess.run([sys.executable, "-m", "jobs.cancel", job.group(1), "--job-dir",
                            str(work / "runs")], cwd=REPO, env=env, capture_output=True)
        proc.wait(timeout=300)
    return verdict(fault, run_dir, began, ended, 0 if fault == "GPU" else before)


def named(run_dir: Path) -> list[dict[str, Any]]:
    """The run's slow_rank events so far."""
    return [e for e in RunFolder(run_dir).events().read() if e["event"] == "slow_rank"]


def verdict(fault: str, run_dir: Path, began: float, ended: float, before: int) -> dict[str, Any]:
    """What the run recorded about the fault: the first slow_rank event, its timing, clips/s."""
    windows = [r for r in RunFolder(run_dir).metrics().read() if "samples_per_second" in r]
    events = named(run_dir)
    first = events[0] if events else {}
    at = min((r["step"] for r in windows if r.get("slow_ranks")), default=None)

    def clips(rows: list[dict[str, Any]]) -> float | None:
        return sum(r["samples_per_second"] for r in rows) / len(rows) if rows else None

    kept = ("step", "samples_per_second", "data_wait", "compute_s", "arrive_s", "wait_s", "late_rank",
            "late_cause", "late_s", "late")
    return {"fault": fault, "named_rank": first.get("rank"), "named_cause": first.get("cause"),
            "lost_s_per_step": first.get("lost_s"), "detail": first.get("detail"),
            "windows_to_named": len([r for r in windows if before < r["step"] <= at]) if at else None,
            "named_events": len(events), "fault_lasted_s": round(ended - began, 1),
            "clips_per_s_before": clips([r for r in windows if r["time"] < began and r["step"] > 1]),
            "clips_per_s_during": clips([r for r in windows if began < r["time"] <= ended]),
            "fault_began_s": round(began - windows[0]["time"], 1) if windows else None,
            "windows": [{k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in kept if k in r}
                        for r in windows]}


def duty_cycle(text: str) -> tuple[float, float]:
    """"STOPPED,RUNNING" seconds → (stopped, running)."""
    stopped, running = (float(x) for x in text.split(","))
    return stopped, running


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a prepared folder (taehv prepare's --out)")
    p.add_argument("--gpus", type=int, default=4, help="GPUs (of each node, with --cluster)")
    p.add_argument("--cluster", help="a Slurm cluster config: the runs go through Slurm on it")
    p.add_argument("--nodes", type=int, default=1, help="nodes, with --cluster")
    p.add_argument("--synthetic", action="store_true", help="synthetic 128×192 clips instead of --data")
    p.add_argument("--cpus", type=int, default=12, help="cpus_per_task")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--fault-step", type=int, help="the victim's step where the fault begins (60, --smoke 16)")
    p.add_argument("--fault-s", type=float, help="seconds the fault (none: a clean run) lasts (90, smoke 15)")
    p.add_argument("--until-named", action="store_true",
                   help="end each fault once the run names a slow rank (it lasts --fault-s at most)")
    p.add_argument("--host-cycle", type=duty_cycle, default=(0.25, 0.25), help="STOPPED,RUNNING s (host)")
    p.add_argument("--data-cycle", type=duty_cycle, default=(0.45, 0.05), help="STOPPED,RUNNING s (data)")
    p.add_argument("--gpu-extra-s", type=float, default=0.25, help="the GPU fault's device seconds per step")
    p.add_argument("--log-every", type=int,
                   help=f"steps per log window (the config's; --synthetic: {SYNTHETIC_LOG_EVERY})")
    p.add_argument("--work", default="/tmp/taehv-slow-rank-faults")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for a run to reach a step")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny config, 2 ranks, short faults")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.fault_step = args.fault_step or (16 if args.smoke else 60)  # past the warm-up
    args.fault_s = args.fault_s or (15 if args.smoke else 90)
    if args.smoke:
        args.cpus, args.timeout = 1, 600
    elif not (args.data or args.synthetic):
        p.error("--data PREPARED or --synthetic is needed on GPUs (or --smoke)")
    if args.nodes > 1 and not args.cluster:
        p.error("--nodes needs --cluster (a Slurm cluster config)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    info = run_info(not args.smoke, gpus=ranks(args), nodes=args.nodes, cluster=args.cluster,
                    data="synthetic 128x192" if args.synthetic else args.data, fault_step=args.fault_step,
                    fault_s=args.fault_s, until_named=args.until_named, host_cycle=args.host_cycle,
                    data_cycle=args.data_cycle, gpu_extra_s=args.gpu_extra_s, log_every=log_every(args))
    rows = []
    for fault in args.faults.split(","):
        rows.append(one_fault(fault, args, work))
        print(json.dumps(rows[-1]), flush=True)
    write_results(args.out, "slow_rank_faults_smoke" if args.smoke else "slow_rank_faults",
                  {"info": info, "rows": rows}, gpus=1 if args.smoke else ranks(args))


if __name__ == "__main__":
    main()
