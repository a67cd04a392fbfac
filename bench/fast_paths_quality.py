"""Quality with the student's fast paths: configs/train/taehv.yaml through `jobs.submit --local` for its first
200 steps, as shipped and with every fast path off (the published block order), and each run's exported
model's PSNR.

    python bench/fast_paths_quality.py             # GPU: 12×480×720 clips, 200 steps of 16 clips
    python bench/fast_paths_quality.py --smoke     # CPU, tiny, a minute: checks the script runs

The data is bench/e2e_throughput.py's (H.264 files of moving synthetic scenes, the teacher's latents in
prepared shards, under --work). Runs, in this order: `shipped` twice (run-to-run noise: cuDNN's algorithm
choice and atomic adds are not deterministic) and `reference` (TAEHV_FAST_PATHS_OFF names every fast path)
once. The shipped config's schedule is kept (lr warm-up over 2000 steps); only the effective batch is smaller
(--effective, 16 = 4 micro-batches of 4 on one GPU: the 200 steps take a minute, not seven) and the
validation held out and run more often. Each run: its logged loss, reconstruction and latent losses and PSNR
at every --log-every steps, its validation PSNR, and `taehv export` of its last checkpoint (fp16) with that
file's PSNR on the validation clips, the weights loaded into a fresh TAEHV (fp32). The summary gives, per
logged step, the largest relative loss difference between the two shipped runs (the noise) and between
shipped and reference. JSON under bench/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import run_info, write_results  # noqa: E402
from bench.e2e_throughput import SHIPPED, local_cluster, prepare_data, run, shipped_with  # noqa: E402
from taehv_slurm.common.runfolder import JobDir  # noqa: E402
from taehv_slurm.trainer.data import ClipSpec  # noqa: E402
from taehv_slurm.trainer.layers import FAST_PATHS, FAST_PATHS_OFF_ENV  # noqa: E402

RUNS = (("shipped", ""), ("shipped", ""), ("reference", ",".join(FAST_PATHS)))
LOSSES = ("loss", "reconstruction_loss", "latent_loss", "psnr")


def settings(args: argparse.Namespace, prepared: Path) -> dict[str, Any]:
    """The `--set` overrides: the data, the steps, the smaller batch, the logging and validation."""
    sets: dict[str, Any] = {"data.path": str(prepared), "steps": args.steps,
                            "batch.effective": args.effective, "data.val_clips": args.val_clips,
                            "intervals.log_every": args.log_every, "intervals.val_every": args.steps // 2}
    if args.smoke:
        sets.update({"data.frames": 8, "data.height": 64, "data.width": 64, "model.encoder_width": 16,
                     "model.decoder_widths": "[32,32,16,16]"})
    return sets


def exported_psnr(weights: Path, cfg_sets: dict[str, Any], device: torch.device) -> float:
    """The mean PSNR over the validation clips of the exported weights in a fresh TAEHV (fp32)."""
    from safetensors.torch import load_file

    from taehv_slurm.trainer.build import build_sources
    from taehv_slurm.trainer.losses import DistillModule
    from taehv_slurm.trainer.model import TAEHV, TAEHVConfig

    cfg = shipped_with(cfg_sets)
    student = TAEHV(TAEHVConfig.from_dict(cfg.model_fields()))
    student.load_state_dict({k: v.float() for k, v in load_file(str(weights)).items()})
    module = DistillModule(student.to(device).eval())
    _, val = build_sources(cfg)
    values = []
    with torch.no_grad():
        for i in range(len(val)):
            clip = val[i]
            _, metrics = module(clip["frames"][None].to(device), None)
            values.append(float(metrics["psnr"]))
    return sum(values) / len(values)


def one_run(label: str, off: str, args: argparse.Namespace, work: Path, cluster: Path,
            sets: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """`jobs.submit --local` with the shipped config and `sets`, fast paths `off`; then `jobs.export`."""
    name = f"quality-{label}-{time.strftime('%H%M%S')}"
    if off:
        os.environ[FAST_PATHS_OFF_ENV] = off
    try:
        overrides = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        out = run([sys.executable, "-m", "jobs.submit", "--local", "--cluster", str(cluster), "--train",
                   str(SHIPPED), "--name", name, *overrides], work / f"{name}.log", args.timeout)
    finally:
        os.environ.pop(FAST_PATHS_OFF_ENV, None)
    run_dir = JobDir(work / "runs").run(name)
    rows = run_dir.metrics().read()
    row: dict[str, Any] = {"label": label, "fast_paths_off": off, "exit": out.returncode,
                           "train": [{k: r[k] for k in ("step", *LOSSES, "samples_per_second") if k in r}
                                     for r in rows if "loss" in r],
                           "val": [{k: v for k, v in r.items() if k == "step" or k.startswith("val")}
                                   for r in rows if any(k.startswith("val") for k in r)]}
    if out.returncode == 0:
        weights = work / f"{name}.safetensors"
        export = subprocess.run([sys.executable, "-m", "jobs.export", str(run_dir.path),
                                 "--out", str(weights)], cwd=REPO, capture_output=True, text=True)
        if export.returncode != 0:
            sys.exit(f"error: taehv export failed: {export.stderr.strip()[-500:]}")
        row["exported_psnr"] = exported_psnr(weights, sets, device)
    print(json.dumps({k: v for k, v in row.items() if k != "train"}), flush=True)
    return row


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, float]:
    """Per metric, the largest |a − b| / |b| over the steps both logged."""
    by_step = {r["step"]: r for r in b}
    out = {}
    for key in LOSSES:
        pairs = [(r[key], by_step[r["step"]][key]) for r in a if r["step"] in by_step and key in r]
        if pairs:
            out[key] = max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The noise (shipped against shipped) and the difference (reference against shipped) so far."""
    train = {(r["label"], i): r["train"] for i, r in enumerate(runs)}
    summary: dict[str, Any] = {"exported_psnr": {f"{r['label']}_{i}": r.get("exported_psnr")
                                                 for i, r in enumerate(runs)}}
    if ("shipped", 1) in train:
        summary["noise_shipped_twice"] = compare(train["shipped", 1], train["shipped", 0])
    if ("reference", 2) in train:
        summary["reference_vs_shipped"] = compare(train["reference", 2], train["shipped", 0])
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", help="videos, teacher, shards and runs (default /tmp/taehv-quality[-smoke])")
    p.add_argument("--videos", type=int, default=40, help="H.264 files of 36 frames: 3 windows each")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--effective", type=int, default=16, help="batch.effective (the shipped config: 128)")
    p.add_argument("--val-clips", type=int, default=24)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600, help="seconds per CLI run")
    p.add_argument("--smoke", action="store_true", help="CPU, 8×64×64 clips, a tiny student and teacher")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.videos, args.steps, args.effective, args.val_clips, args.log_every = 3, 4, 2, 2, 1
    on_gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if on_gpu else "cpu")
    work = Path(args.work or f"/tmp/taehv-quality{'-smoke' if args.smoke else ''}")
    work.mkdir(parents=True, exist_ok=True)
    spec = ClipSpec(8, 64, 64) if args.smoke else ClipSpec(12, 480, 720)
    cluster = local_cluster(work, on_gpu, 1 if args.smoke else 12)
    prepared = prepare_data(work, spec, args.videos, 16 if args.smoke else 36, cluster, args.smoke,
                            args.timeout, "--no-compile")
    sets = settings(args, prepared)
    info = run_info(on_gpu, clip=[spec.frames, spec.height, spec.width], steps=args.steps,
                    effective_batch=args.effective, settings=sets)
    out = args.out  # the file is written after each run, to one path: a call cut short keeps what it had
    runs: list[dict[str, Any]] = []
    for label, off in RUNS:
        runs.append(one_run(label, off, args, work, cluster, sets, device))
        summary = summarize(runs)
        out = str(write_results(out, "fast_paths_quality_smoke" if args.smoke else "fast_paths_quality",
                                {"info": info, "summary": summary, "runs": runs}))
    print(json.dumps(summary, indent=1), flush=True)
    if any(r["exit"] != 0 for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
