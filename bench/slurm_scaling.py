"""Clips/s per GPU through `taehv submit` on a Slurm cluster at several node × GPU shapes, on prepared shards.

    python -m tests.slurm_testbed start --dir /tmp/gpucluster --nodes 2 --real-gpus [--slurm-debs DIR] \
        --no-accounting && . /tmp/gpucluster/env.sh
    python bench/slurm_scaling.py --cluster configs/cluster/gpu_testbed.yaml --shapes 1x1,1x2,2x1,2x2
    python bench/slurm_scaling.py --smoke      # the CPU testbed, tiny clips: checks the whole path runs

1. Data as a user makes it: --videos H.264 files (bench/e2e_throughput.py's moving scenes), HunyuanVideo's VAE
   in its default architecture with seeded random weights, and `taehv prepare --cluster ... --follow` over the
   largest shape's nodes and GPUs: the shards training reads.
2. For each shape N×G: `taehv submit --cluster ... --nodes N --gpus-per-node G --train
   configs/train/taehv.yaml --follow` with only the data path, steps and a finer log interval set (the plan
   picks the split, engine and loader as for a user), and NCCL_DEBUG=INFO.
3. Per shape: clips/s per GPU over the log windows after --warmup-steps, against 1×1's; the slowest rank's
   data wait; peak GPU memory; the transports NCCL reports between ranks (its "via NET/Socket" and "via P2P"
   lines in the rank logs); and the NCCL variables each rank's process had (read from /proc while it ran)
   against the plan's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import run_info, write_results  # noqa: E402
from bench.e2e_throughput import make_teacher, make_videos, prepare_figures, steady  # noqa: E402
from taehv_slurm.common.config import load_cluster, load_train, split_overrides  # noqa: E402
from taehv_slurm.common.plan import plan_for_cluster  # noqa: E402
from taehv_slurm.common.runfolder import RunFolder  # noqa: E402
from taehv_slurm.common.typed_yaml import parse_set_args  # noqa: E402

SHIPPED = REPO / "configs/train/taehv.yaml"
# The tiny clips and model of --smoke (the CPU testbed): the same path, seconds instead of minutes.
SMOKE_SETS = {"data.frames": 8, "data.height": 64, "data.width": 64, "data.val_clips": 2,
              "model.encoder_width": 16, "model.decoder_widths": "[32,32,16,16]", "batch.effective": 8,
              "engine.compile": "false", "device": "cpu"}
# NCCL's INFO line of one channel: "Channel 00/0 : 3[3] -> 0[0] [receive] via NET/Socket/0"
TRANSPORT = re.compile(r" : (\d+)\[(\d+)\] -> (\d+)\[(\d+)\] (?:\[\w+\] )?via (\S+)")


def taehv(args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int, float]:
    """`python -m taehv_slurm ARGS` as a user runs it; (exit code, seconds); its output goes to `log`."""
    began = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run([sys.executable, "-m", "taehv_slurm", *args], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = 124
    seconds = time.perf_counter() - began
    print(f"$ taehv {' '.join(args)}\n  exit {code} in {seconds:.0f} s (log {log})", flush=True)
    if code:
        print(log.read_text()[-3000:], flush=True)
    return code, seconds


def sets(values: dict[str, Any]) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


class RankEnviron(threading.Thread):
    """Polls a run's rank records while it trains and reads each live rank's NCCL variables from /proc (the
    cluster's nodes share this host)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.found, self.stop = run_dir, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            for record in RunFolder(self.run_dir).ranks.glob("*.json"):
                try:
                    info = json.loads(record.read_text())
                    raw = Path(f"/proc/{info['pid']}/environ").read_bytes().decode(errors="replace")
                except (OSError, ValueError, KeyError):
                    continue
                env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
                nccl = {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}
                if info.get("step"):  # training: the process group and its variables are set
                    self.found[int(record.stem)] = {"host": info.get("host"), "env": nccl}


def transports(run_dir: Path) -> dict[str, int]:
    """How many NCCL channel connections each transport carries, from the ranks' NCCL_DEBUG=INFO lines."""
    counts: dict[str, int] = {}
    for log in RunFolder(run_dir).submitit.glob("*_log.out"):
        for match in TRANSPORT.finditer(log.read_text(errors="replace")):
            kind = match.group(5).split("/")[0] + ("/" + match.group(5).split("/")[1]
                                                   if match.group(5).startswith("NET") else "")
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def measure(shape: tuple[int, int], engine: str, args: argparse.Namespace, prepared: Path,
            job_dir: Path) -> dict[str, Any]:
    """One run of the shipped config at `shape` (nodes, GPUs per node) with `engine` (auto: the plan's)."""
    nodes, gpus = shape
    name = f"scale-{nodes}x{gpus}-{engine}-{time.strftime('%H%M%S')}"
    speed = {"zero3": 3, "zero2": 1.5}.get(engine, 1)  # steps take longer: fewer of them
    overrides = {"data.path": prepared, "engine.kind": engine,
                 "steps": int(args.steps_per_gpu / speed) // (nodes * gpus) + args.warmup_steps,
                 "intervals.log_every": 2, "intervals.val_every": 100_000, "intervals.ckpt_every": 100_000,
                 "env.NCCL_DEBUG": "INFO", "job_dir": job_dir, **(SMOKE_SETS if args.smoke else {})}
    watcher = RankEnviron(job_dir / name)
    watcher.start()
    code, seconds = taehv(["submit", "--cluster", args.cluster, "--nodes", str(nodes), "--gpus-per-node",
                           str(gpus), "--train", str(SHIPPED), "--name", name, "--follow", *sets(overrides)],
                          args.work / f"{name}.log", args.timeout)
    watcher.stop.set()
    run_dir = job_dir / name
    rows = RunFolder(run_dir).metrics().read()
    cluster_sets, train_sets = split_overrides(parse_set_args(sets(overrides)[1::2]))
    cluster = load_cluster(args.cluster, nodes=nodes, gpus_per_node=gpus, **cluster_sets)
    train = load_train(SHIPPED, **train_sets)
    plan = plan_for_cluster(cluster, train)
    figures = steady(rows, args.warmup_steps, plan.effective_batch)
    ranks_env = watcher.found  # the ranks seen alive while training (a short run may end between polls)
    hosts = {int(p.stem): json.loads(p.read_text()).get("host")
             for p in RunFolder(run_dir).ranks.glob("*.json")}
    return {"shape": f"{nodes}x{gpus}", "engine_asked": engine, "nodes": nodes, "gpus_per_node": gpus,
            "exit": code, "wall_s": round(seconds, 1), "engine": plan.engine, "grad_accum": plan.grad_accum,
            "loader_workers": plan.num_workers, **figures,
            "clips_per_s_per_gpu": figures["clips_per_s"] / (nodes * gpus) if figures else None,
            "transports": transports(run_dir), "plan_nccl_env": plan.nccl_env,
            "ranks_got_plan_env": bool(ranks_env) and all(
                all(r["env"].get(k) == v for k, v in plan.nccl_env.items()) for r in ranks_env.values()),
            "ranks_seen": {str(k): v for k, v in sorted(ranks_env.items())},
            "rank_hosts": {str(k): v for k, v in sorted(hosts.items())}}  # from each rank's own record


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default=str(REPO / "configs/cluster/gpu_testbed.yaml"))
    p.add_argument("--shapes", default="1x1,1x2,2x1,2x2", help="NODESxGPUS, comma-separated")
    p.add_argument("--engines", default="", help="engines to run at the largest shape besides the plan's "
                                                 "(e.g. zero1,zero2,zero3)")
    p.add_argument("--skip-shapes", action="store_true", help="only the --engines runs")
    p.add_argument("--work", type=Path, default=Path("/tmp/taehv-slurm-scaling"))
    p.add_argument("--videos", type=int, default=32, help="H.264 files of --video-frames frames (480×720): "
                                                         "4 windows each, 64 of them held out for validation")
    p.add_argument("--video-frames", type=int, default=48)
    p.add_argument("--steps-per-gpu", type=int, default=24, help="measured steps × GPUs (so each shape "
                                                                   "runs about as long)")
    p.add_argument("--warmup-steps", type=int, default=6, help="steps left out (compile, CUDA graphs)")
    p.add_argument("--timeout", type=float, default=400, help="seconds per command")
    p.add_argument("--smoke", action="store_true", help="the CPU testbed, tiny clips and teacher")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.cluster = str(REPO / "configs/cluster/testbed.yaml")
        args.videos, args.video_frames, args.steps_per_gpu, args.warmup_steps = 2, 16, 4, 2
    return args


def prepare_shards(args: argparse.Namespace, shape: tuple[int, int], job_dir: Path) -> dict[str, Any]:
    """Videos, the teacher and `taehv prepare` over `shape` into <work>/prepared (kept: reused next time);
    its figures, or {} when the shards were there already."""
    nodes, gpus = shape
    frames, height, width = (8, 64, 64) if args.smoke else (12, 480, 720)
    began = time.perf_counter()
    make_videos(args.work / "videos", args.videos, args.video_frames, height, width)
    make_teacher(args.work / "hv-vae", tiny=args.smoke)
    print(f"videos and teacher ready in {time.perf_counter() - began:.0f} s", flush=True)
    if (args.work / "prepared" / "index.csv").is_file():
        return {}
    code, seconds = taehv(["prepare", "--cluster", args.cluster, "--nodes", str(nodes), "--gpus-per-node",
                           str(gpus), "--data", str(args.work / "videos"),
                           "--out", str(args.work / "prepared"),
                           "--teacher-path", str(args.work / "hv-vae"), "--frames", str(frames),
                           "--height", str(height), "--width", str(width), "--shard-size", "16", "--follow",
                           "--set", f"job_dir={job_dir}", *(["--set", "device=cpu", "--no-compile"]
                                                             if args.smoke else [])],
                          args.work / "prepare.log", args.timeout)
    if code:
        sys.exit("error: taehv prepare failed; see above")
    return {"shape": f"{nodes}x{gpus}", "wall_s": round(seconds, 1), **prepare_figures(job_dir)}


def print_table(rows: list[dict[str, Any]], prepare: dict[str, Any]) -> None:
    print(f"\n{'shape':>5} {'engine':>9} {'clips/s/GPU':>11} {'scaling':>7} {'data wait':>9} {'peak GiB':>8}"
          "  transports")
    for r in rows:
        if not r.get("clips_per_s_per_gpu"):
            print(f"{r['shape']:>5} {r['engine']:>9}  failed (exit {r['exit']})")
            continue
        scaling = f"{100 * r['scaling']:>6.1f}%" if r["scaling"] else " " * 7
        print(f"{r['shape']:>5} {r['engine']:>9} {r['clips_per_s_per_gpu']:>11.2f} {scaling} "
              f"{100 * r['data_wait']:>8.1f}% {r['peak_gib']:>8.1f}  {r['transports']}  "
              f"plan env on every rank: {r['ranks_got_plan_env']}")
    if prepare:
        print(f"prepare over {prepare['shape']}: {prepare}")


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    largest = max(shapes, key=lambda s: s[0] * s[1])
    job_dir = args.work / "runs"
    prepare = prepare_shards(args, largest, job_dir)
    runs = [] if args.skip_shapes else [(shape, "auto") for shape in shapes]
    runs += [(largest, engine) for engine in filter(None, args.engines.split(","))]
    rows = []
    for shape, engine in runs:
        rows.append(measure(shape, engine, args, args.work / "prepared", job_dir))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "ranks_seen"}), flush=True)
    base = next((r["clips_per_s_per_gpu"] for r in rows if r["shape"] == "1x1"), None)
    auto = {r["shape"]: r["clips_per_s_per_gpu"] for r in rows if r["engine_asked"] == "auto"}
    for r in rows:
        r["scaling"] = r["clips_per_s_per_gpu"] / base if base and r["clips_per_s_per_gpu"] else None
        if r["engine_asked"] != "auto" and auto.get(r["shape"]) and r["clips_per_s_per_gpu"]:
            r["vs_plan_engine"] = r["clips_per_s_per_gpu"] / auto[r["shape"]]
    cluster = Path(args.cluster).resolve()
    info = run_info(not args.smoke, command=" ".join(sys.argv[1:]),
                    cluster=str(cluster.relative_to(REPO)) if cluster.is_relative_to(REPO) else str(cluster))
    write_results(args.out, "slurm_scaling", {**info, "prepare": prepare, "shapes": rows},
                  gpus=max(r["nodes"] * r["gpus_per_node"] for r in rows))
    print_table(rows, prepare)


if __name__ == "__main__":
    main()
