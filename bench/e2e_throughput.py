"""What a user gets: clips/s per GPU of `python -m jobs.submit --local` with configs/train/taehv.yaml as
shipped, beside the isolated training step on the same GPU.

    python bench/e2e_throughput.py                                  # one GPU: prepared, synthetic, video
    python bench/e2e_throughput.py --sources prepared --steps 30
    python bench/e2e_throughput.py --smoke                          # CPU, tiny: checks the whole path runs
    python bench/e2e_throughput.py --sources prepared --gpus 4 --watchers-ab 2  # the watchers' cost on 4 GPUs

1. Data: --videos real H.264 files of --video-frames frames at 480×720 (moving synthetic scenes), written
   with PyAV into --work (kept there: a second run reuses them).
2. Teacher: diffusers' AutoencoderKLHunyuanVideo in its default (real) architecture with seeded random
   weights, saved as a local diffusers folder (no download; the cost does not depend on the values).
3. `python -m jobs.prepare --local` on those videos with that teacher: the shards training reads.
4. For each source (prepared shards, the same videos decoded while training, synthetic clips):
   `python -m jobs.submit --local --cluster <1 GPU, --cpus cores> --train configs/train/taehv.yaml` with
   only data.source/path, steps and a finer log interval set: the plan picks the accumulation (32 on 1
   GPU), the engine, CUDA graphs and the loader workers, as for a user.
5. The isolated step: the same engine, model and accumulation on micro-batches already on the GPU.

Per source: end-to-end clips/s (the log windows after --warmup-steps: compile and graph capture excluded),
the isolated step's clips/s, their ratio, the fraction of step time the trainer waited for data (the
slowest rank's, from the log lines), and peak GPU memory. JSON under bench/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import run_info, write_results  # noqa: E402
from bench.prepare_throughput import write_h264  # noqa: E402
from taehv_slurm.common.config import TrainConfig, load_train  # noqa: E402
from taehv_slurm.common.plan import plan_for  # noqa: E402
from taehv_slurm.common.runfolder import JobDir, RunFolder  # noqa: E402
from taehv_slurm.common.typed_yaml import parse_set_args  # noqa: E402
from taehv_slurm.goodput import goodput_frame  # noqa: E402
from taehv_slurm.trainer.data import ClipSpec, SyntheticClips  # noqa: E402

SHIPPED = REPO / "configs/train/taehv.yaml"


def make_video(args: tuple[Path, int, int, int, int]) -> None:
    path, index, frames, height, width = args
    if not path.exists():
        scene = SyntheticClips(index + 1, ClipSpec(frames, height, width), seed=17)[index]["frames"].numpy()
        write_h264(path, scene)


def make_videos(folder: Path, count: int, frames: int, height: int, width: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(folder / f"clip{i:03d}.mp4", i, frames, height, width) for i in range(count)]
    with multiprocessing.get_context("spawn").Pool(max(1, min(count, (os.cpu_count() or 2) - 1))) as pool:
        pool.map(make_video, jobs)


def make_teacher(folder: Path, tiny: bool) -> None:
    """HunyuanVideo's VAE as a local diffusers folder: its default architecture (or a tiny one), seeded
    weights."""
    if (folder / "config.json").is_file():
        return
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    options = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4) if tiny else {}
    vae = AutoencoderKLHunyuanVideo(**options)
    vae.to(torch.bfloat16).save_pretrained(str(folder))


def local_cluster(work: Path, on_gpu: bool, cpus: int, watched: bool = True, gpus: int = 1) -> Path:
    """A local cluster config of `gpus` GPUs (on the CPU, that many ranks), as a user with them writes it;
    `watched` False turns the hang watchdog and the slow-rank timing off (the A/B of their cost: with
    several GPUs it includes timing the step's collectives, which one GPU does not run)."""
    path = work / f"{'one_gpu' if gpus == 1 else f'{gpus}_gpus'}{'' if watched else '_unwatched'}.yaml"
    path.write_text(f"backend: local\nnodes: 1\ngpus_per_node: {gpus if on_gpu else 0}\n"
                    f"tasks_per_node: {gpus}\n"
                    f"cpus_per_task: {cpus}\ndevice: {'cuda' if on_gpu else 'cpu'}\ntime_min: 600\n"
                    f"signal_delay_s: 60\njob_dir: {work / 'runs'}\n"
                    + ("" if watched else "hang_detection: false\nslow_rank_windows: 0\n"))
    return path


def prepare_data(work: Path, spec: ClipSpec, videos: int, video_frames: int, cluster: Path,
                 tiny_teacher: bool, timeout: float, flags: str = "") -> Path:
    """Videos, the teacher folder and `jobs.prepare --local` on them, under `work` (kept: reused next time);
    returns the prepared folder."""
    began = time.perf_counter()
    make_videos(work / "videos", videos, video_frames, spec.height, spec.width)
    make_teacher(work / "hv-vae", tiny=tiny_teacher)
    print(f"videos and teacher ready in {time.perf_counter() - began:.0f} s", flush=True)
    prepared = work / "prepared"
    if not (prepared / "index.csv").is_file():
        shape = ["--frames", str(spec.frames), "--height", str(spec.height), "--width", str(spec.width)]
        out = run([sys.executable, "-m", "jobs.prepare", "--data", str(work / "videos"),
                   "--out", str(prepared), "--teacher-path", str(work / "hv-vae"), "--local",
                   "--cluster", str(cluster), *shape, *shlex.split(flags)],
                  work / "prepare.log", timeout)
        if out.returncode != 0:
            sys.exit("error: jobs.prepare failed; see above")
    return prepared


def run(argv: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    """A CLI as the user runs it; its output goes to `log` (and the last lines on failure to us)."""
    began = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                                       os.environ.get("PYTHONPATH")]))})
    log.write_text(out.stdout + out.stderr)
    shown = [a.replace(f"{REPO}{os.sep}", "") for a in argv[1:]]  # repo files by their path in the repo
    print(f"$ {' '.join(shown)}\n  exit {out.returncode} in {time.perf_counter() - began:.0f} s "
          f"(log {log})", flush=True)
    if out.returncode != 0:
        print((out.stdout + out.stderr)[-3000:], flush=True)
    return out


def steady(rows: list[dict[str, Any]], warmup_steps: int, effective: int) -> dict[str, float]:
    """Clips/s and data-wait fraction over the log windows that begin after `warmup_steps`."""
    train = [r for r in rows if "samples_per_second" in r]
    windows = [(r, r["step"] - p["step"]) for p, r in zip(train, train[1:]) if p["step"] >= warmup_steps]
    if not windows:
        return {}
    seconds = sum(n * effective / r["samples_per_second"] for r, n in windows)
    clips = sum(n * effective for _, n in windows)
    wait = sum(r["data_wait"] * n * effective / r["samples_per_second"] for r, n in windows) / seconds
    return {"clips_per_s": clips / seconds, "data_wait": wait, "steps_measured": sum(n for _, n in windows),
            "peak_gib": max((r.get("gpu_memory_gb") or 0.0) for r in train) * 1e9 / 2**30}


def isolated_step(train_cfg: dict[str, Any], with_latents: bool, device: torch.device, steps: int) -> float:
    """Clips/s of the trainer's own engine on micro-batches already on the device (no loader)."""
    from taehv_slurm.trainer.build import configure_backends
    from taehv_slurm.trainer.engine import Microbatch, make_engine
    from taehv_slurm.trainer.losses import DistillModule
    from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, init_for_training

    cfg = load_train(train_cfg)
    plan = plan_for(1, 1 if device.type == "cuda" else 0, cfg, device=device.type)
    configure_backends(device)
    torch.manual_seed(0)
    student = TAEHV(TAEHVConfig.from_dict(cfg.model_fields()))
    init_for_training(student)
    student.to(device)
    on_gpu = device.type == "cuda"
    if cfg.engine.channels_last and on_gpu:
        student.to(memory_format=torch.channels_last)
    module = DistillModule(student, cfg.loss.latent_weight, cfg.loss.reconstruction_weight,
                           cfg.loss.decoder_weight)
    engine = make_engine(plan.engine, module, device, precision=plan.precision, grad_clip=cfg.optim.grad_clip,
                         lr=plan.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
                         compile=cfg.engine.compile and on_gpu, compile_mode=cfg.engine.compile_mode,
                         per_gpu_batch=plan.per_gpu_batch, grad_accum=plan.grad_accum)
    d = cfg.data
    sizes = plan.microbatch_sizes(0)
    batches = []
    for size in sorted(set(sizes)):
        frames = torch.randint(0, 256, (size, d.frames, 3, d.height, d.width), dtype=torch.uint8,
                               device=device)
        latents = torch.randn(size, d.frames // 4, cfg.model.latent_channels, d.height // 8, d.width // 8,
                              device=device) if with_latents else None
        batches.append((size, frames, latents))
    by_size = {size: (frames, latents) for size, frames, latents in batches}
    step = [Microbatch(*by_size[size], size / plan.effective_batch) for size in sizes]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(3):  # compile, graph capture, cuDNN autotuning
        engine.train_step(step, plan.lr).means()
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        engine.train_step(step, plan.lr)
    sync()
    return steps * plan.effective_batch / (time.perf_counter() - began)


def parse_args() -> argparse.Namespace:
    """The command line, with --smoke's tiny counts applied."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/taehv-e2e",
                   help="videos, teacher and shards (reused by a second run)")
    p.add_argument("--sources", default="prepared,video,synthetic", help="'': only prepare the data")
    p.add_argument("--videos", type=int, default=48)
    p.add_argument("--prepare-flags", default="",
                   help="more jobs.prepare flags for the data (e.g. '--no-compile': the teacher's rate is "
                        "bench/prepare_e2e.py's; training reads the same shards)")
    p.add_argument("--video-frames", type=int, default=36, help="frames per file: 3 training windows of 12")
    p.add_argument("--steps", type=int, default=30, help="training steps per source")
    p.add_argument("--warmup-steps", type=int, default=6, help="steps left out of the end-to-end figure")
    p.add_argument("--cpus", type=int, default=12, help="cpus_per_task of the cluster config")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs (ranks) of the end-to-end runs; the isolated step uses one")
    p.add_argument("--isolated-steps", type=int, default=5, help="0: skip the isolated step")
    p.add_argument("--timeout", type=float, default=900, help="seconds per CLI run")
    p.add_argument("--watchers-ab", type=int, default=0, metavar="PAIRS",
                   help="per source, PAIRS runs with the hang watchdog and slow-rank timing on and off, "
                        "alternating (their overhead); 0: one run, watchers on as shipped")
    p.add_argument("--smoke", action="store_true", help="CPU, 8×64×64 clips, a tiny teacher, 3 steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="another override of the shipped config for every run (e.g. batch.per_gpu=2)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.videos, args.video_frames, args.steps, args.warmup_steps, args.isolated_steps = 3, 16, 3, 1, 1
        args.cpus = 1
    return args


def source_settings(source: str, args: argparse.Namespace, work: Path, prepared: Path,
                    spec: ClipSpec) -> dict[str, Any]:
    """The `--set` overrides of one source's run: its data, steps and a finer log interval (smoke: tiny)."""
    sets: dict[str, Any] = {"data.source": source,
                            "data.path": str(prepared if source == "prepared" else work / "videos"),
                            "steps": args.steps, "intervals.log_every": 2}
    if args.smoke:
        sets.update({"data.frames": spec.frames, "data.height": spec.height, "data.width": spec.width,
                     "data.val_clips": 2, "data.num_clips": 64, "model.encoder_width": 16,
                     "model.decoder_widths": "[32,32,16,16]", "batch.effective": 8})
    sets.update(parse_set_args(args.sets))
    return sets


def shipped_with(sets: dict[str, Any]) -> TrainConfig:
    """The shipped config with a run's `--set` overrides (a "[..]" value is a YAML list)."""
    return load_train(load_train(SHIPPED).to_dict(),
                      **{k: (json.loads(v) if isinstance(v, str) and v.startswith("[") else v)
                         for k, v in sets.items()})


def measure_source(source: str, args: argparse.Namespace, work: Path, prepared: Path, cluster: Path,
                   spec: ClipSpec, device: torch.device) -> dict[str, Any]:
    """One source: `jobs.submit --local` with the shipped config, its steady figures and the isolated step."""
    on_gpu = device.type == "cuda"
    name = f"e2e-{source}-{time.strftime('%H%M%S')}"
    sets = source_settings(source, args, work, prepared, spec)
    argv = [sys.executable, "-m", "jobs.submit", "--local", "--cluster", str(cluster),
            "--train", str(SHIPPED), "--name", name,
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    out = run(argv, work / f"{name}.log", args.timeout)
    lines = JobDir(work / "runs").run(name).metrics().read()
    train_cfg = shipped_with(sets)  # the plan the run had
    plan = plan_for(1, args.gpus if on_gpu else 0, train_cfg, cpus_per_task=args.cpus, device=device.type)
    row: dict[str, Any] = {"source": source, "exit": out.returncode, "grad_accum": plan.grad_accum,
                           "per_gpu_batch": plan.per_gpu_batch, "loader_workers": plan.num_workers,
                           "plan_notes": plan.notes, **steady(lines, args.warmup_steps, plan.effective_batch)}
    row.update(start_figures(work / "runs" / name, lines))
    if on_gpu:
        torch.cuda.empty_cache()
    if args.isolated_steps:
        row["isolated_clips_per_s"] = isolated_step(train_cfg.to_dict(), source == "prepared", device,
                                                    args.isolated_steps)
        if "clips_per_s" in row:
            row["ratio"] = row["clips_per_s"] / args.gpus / row["isolated_clips_per_s"]  # per GPU
    return row


def watchers_ab(source: str, args: argparse.Namespace, work: Path, prepared: Path, spec: ClipSpec,
                device: torch.device) -> dict[str, Any]:
    """`--watchers-ab` pairs of runs, watchers on then off, each pair on the same warm compile cache: the
    on-runs' row, with every run's clips/s and the overhead (1 − mean on / mean off)."""
    on_gpu = device.type == "cuda"
    clusters = {w: local_cluster(work, on_gpu, args.cpus, watched=w, gpus=args.gpus) for w in (True, False)}
    no_isolated = argparse.Namespace(**{**vars(args), "isolated_steps": 0})  # the A/B is end to end only
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for _ in range(args.watchers_ab):
        for watched in (True, False):
            row = measure_source(source, no_isolated, work, prepared, clusters[watched], spec, device)
            print(json.dumps({"watched": watched, **row}), flush=True)
            runs[watched].append(row)
    rates = {w: [r.get("clips_per_s") for r in rs] for w, rs in runs.items()}
    row = {**runs[True][-1], "watched_clips_per_s": rates[True], "unwatched_clips_per_s": rates[False]}
    if all(x is not None for x in rates[True] + rates[False]):
        on, off = (sum(rates[w]) / len(rates[w]) for w in (True, False))
        row.update(clips_per_s=on, unwatched_mean=off, watchers_overhead=1 - on / off)
        print(f"{source}: watchers on {on:.2f}, off {off:.2f} clips/s: "
              f"overhead {100 * (1 - on / off):+.2f} %", flush=True)
    return row


def start_figures(run_dir: Path, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Job start (the rank's process) to the first training step, and to the loop's start before it
    (imports, rendezvous, build, restore; the rest is the first step with its compilation), as the run's
    goodput table (`jobs.status --goodput`) gives them for its first attempt; and the last logged MFU."""
    events = RunFolder(run_dir).events().read()
    attempts = goodput_frame(events, [r for r in metrics if "loss" in r], nodes=1, final_step=None)
    first = attempts.head(1).to_dict("records")[0] if len(attempts) else {}

    def known(column: str) -> float | None:  # a run that failed before its start (or first step) has none
        return None if pd.isna(first.get(column)) else float(first[column])

    mfus = [r["mfu"] for r in metrics if r.get("mfu") is not None]
    began = next((e.get("began") for e in events if e["event"] == "start"), None)  # the rank's process
    # precompile.py: how the student ran from each step on (loaded, saved, eager while compiled aside, ...),
    # and when: seconds from the rank's process start, as first_step_s
    compiled = [{"step": e["step"], "student": e["student"],
                 "at_s": None if began is None else round(e["time"] - began, 1)}
                for e in events if e["event"] == "compiled"]
    return {"first_step_s": known("time_to_first_step_s"), "start_up_s": known("start_up_s"),
            "mfu": mfus[-1] if mfus else None, "compiled": compiled or None}


def prepare_figures(job_dir: Path) -> dict[str, Any]:
    """The newest `jobs.prepare` run under `job_dir`: start to its first shard, and clips/s after it (the
    windows of the later shards over the wall time from the first shard written to the last; not over the
    sum of the shards' own seconds, which counts each shard's write twice: it overlaps the next shard's
    encoding)."""
    runs = sorted((log for d in job_dir.glob("prepare-*") if (log := RunFolder(d).events()).path.exists()),
                  key=lambda log: log.path.stat().st_mtime)
    if not runs:
        return {}
    events = runs[-1].read()
    start = next(e for e in events if e["event"] == "start")
    shards = [e for e in events if e["event"] == "shard"]
    later = shards[1:]
    rate = (round(sum(e["windows"] for e in later) / (later[-1]["time"] - shards[0]["time"]), 2)
            if later else None)
    return {"prepare_first_shard_s": round(shards[0]["time"] - start["began"], 1) if shards else None,
            "prepare_clips_per_s_after_first": rate, "prepare_shards": len(shards)}


def print_table(info: dict[str, Any], cpus: int, rows: list[dict[str, Any]]) -> None:
    """The rows as a table on stdout, under the device and versions they were measured with."""
    print(f"\n{info['device']}, {cpus} CPUs per GPU, torch {info['torch']}; "
          "configs/train/taehv.yaml as shipped")
    print(f"{'source':>9} {'accum':>5} {'workers':>7} {'e2e clips/s':>11} {'isolated':>8} {'ratio':>6} "
          f"{'data wait':>9} {'peak GiB':>8}")
    for r in rows:
        if "clips_per_s" not in r:
            print(f"{r['source']:>9}  failed (exit {r['exit']})")
            continue
        isolated = (f"{r['isolated_clips_per_s']:>8.1f} {100 * r['ratio']:>5.0f}%" if "ratio" in r
                    else " " * 15)
        print(f"{r['source']:>9} {r['grad_accum']:>5} {r['loader_workers']:>7} {r['clips_per_s']:>11.1f} "
              f"{isolated} {100 * r['data_wait']:>8.0f}% {r['peak_gib']:>8.1f}  "
              f"first step {r['first_step_s']} s (start-up {r['start_up_s']} s)"
              + "".join(f"; from step {c['step']} (at {c['at_s']} s) the student "
                        f"{'/'.join(c['student'])}" for c in r.get("compiled") or []))


def main() -> None:
    args = parse_args()
    on_gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    frames, height, width = (8, 64, 64) if args.smoke else (12, 480, 720)
    work = Path(args.work if not args.smoke else args.out + ".work" if args.out else "/tmp/taehv-e2e-smoke")
    work.mkdir(parents=True, exist_ok=True)
    info = run_info(on_gpu, clip=[frames, height, width], cpus_per_task=args.cpus, steps=args.steps)
    print(json.dumps(info), flush=True)

    cluster = local_cluster(work, on_gpu, args.cpus)
    spec = ClipSpec(frames, height, width)
    prepared = prepare_data(work, spec, args.videos, args.video_frames, cluster, args.smoke, args.timeout,
                            args.prepare_flags)
    info.update(prepare_figures(work / "runs"))
    print(json.dumps({k: v for k, v in info.items() if k.startswith("prepare")}), flush=True)
    if not args.sources:  # the prepared folder alone, for other benchmarks (bench/slow_rank_faults.py --data)
        print(f"prepared: {prepared}")
        return
    rows = []
    for source in args.sources.split(","):
        if args.watchers_ab:
            rows.append(watchers_ab(source, args, work, prepared, spec, device))
            continue
        ranks = cluster if args.gpus == 1 else local_cluster(work, on_gpu, args.cpus, gpus=args.gpus)
        row = measure_source(source, args, work, prepared, ranks, spec, device)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print_table(info, args.cpus, rows)
    write_results(args.out, "e2e_throughput_smoke" if args.smoke else "e2e_throughput",
                  {"info": info, "rows": rows})
    if any(r["exit"] != 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
