"""What a user gets from `python -m jobs.prepare --local`: teacher clips/s end to end, and start to the first
shard with a cold and a warm compile cache, for its defaults and for other flags on the same files.

    python bench/prepare_e2e.py                  # GPU: before (--no-compile --batch 4), defaults cold, warm
    python bench/prepare_e2e.py --smoke          # CPU, tiny teacher: checks the whole path runs

Videos (480×720 H.264, --video-frames per file) and the HunyuanVideo VAE in its default architecture with
seeded random weights are made as in bench/e2e_throughput.py. Windows are --frames long (16: the teacher
encodes 13 = 1 + 4k of them, the windows of docs/benchmarks.md's teacher figures). Each variant runs
`jobs.prepare` into a fresh output folder; a variant named "…-cold" first empties the job folder's compile
cache. Figures come from the run's own events: start to the first shard written, and clips/s over the
shards after it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import run_info, write_results  # noqa: E402
from bench.e2e_throughput import local_cluster, make_teacher, make_videos, prepare_figures, run  # noqa: E402

# name → jobs.prepare flags beyond the data, teacher and window shape. "before": eager at batch 4, the
# defaults of earlier code; the defaults now compile at batch 2 (bench/prepare_throughput.py: the fastest
# setting).
VARIANTS = {"before": "--no-compile --batch 4",
            "defaults-cold": "",
            "defaults-warm": ""}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/taehv-prepare-e2e", help="videos and teacher (kept for reuse)")
    p.add_argument("--videos", type=int, default=96)
    p.add_argument("--video-frames", type=int, default=48, help="frames per file: 3 windows of 16")
    p.add_argument("--frames", type=int, default=16, help="window length (the teacher encodes 1 + 4k)")
    p.add_argument("--cpus", type=int, default=12, help="cpus_per_task of the 1-GPU cluster config")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="CPU, 64×64, a tiny teacher, eager only")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"which to run, comma-separated (default all: {', '.join(VARIANTS)})")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    on_gpu = torch.cuda.is_available() and not args.smoke
    height, width = (480, 720) if on_gpu else (64, 64)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        sys.exit(f"error: --variants: no variant {', '.join(sorted(unknown))}; "
                 f"choose from {', '.join(VARIANTS)}")
    variants = ({name: VARIANTS[name] for name in args.variants.split(",")} if on_gpu
                else {"smoke: --no-compile --batch 2": "--no-compile --batch 2"})
    if args.smoke:
        args.videos, args.video_frames, args.frames, args.cpus = 2, 16, 8, 1
    smoke_work = args.out + ".work" if args.out else "/tmp/taehv-prepare-smoke"
    work = Path(smoke_work if args.smoke else args.work)
    work.mkdir(parents=True, exist_ok=True)
    info = run_info(on_gpu, window=[args.frames, height, width], videos=args.videos, cpus_per_task=args.cpus)
    print(json.dumps(info), flush=True)
    began = time.perf_counter()
    make_videos(work / "videos", args.videos, args.video_frames, height, width)
    make_teacher(work / "hv-vae", tiny=not on_gpu)
    print(f"videos and teacher ready in {time.perf_counter() - began:.0f} s", flush=True)
    cluster = local_cluster(work, on_gpu, args.cpus)

    rows = []
    for name, flags in variants.items():
        out = work / "prepared"
        shutil.rmtree(out, ignore_errors=True)
        if name.endswith("-cold"):
            shutil.rmtree(work / "runs" / "compile-cache", ignore_errors=True)
        argv = [sys.executable, "-m", "jobs.prepare", "--data", str(work / "videos"), "--out", str(out),
                "--teacher-path", str(work / "hv-vae"), "--local", "--cluster", str(cluster),
                "--frames", str(args.frames), "--height", str(height), "--width", str(width),
                *shlex.split(flags)]
        done = run(argv, work / f"prepare-{len(rows)}.log", args.timeout)
        row = {"variant": name, "flags": flags or "(defaults)", "exit": done.returncode,
               **prepare_figures(work / "runs")}
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{info['device']}, torch {info['torch']}; "
          f"jobs.prepare --local, {args.frames}×{height}×{width} windows")
    for r in rows:
        print(f"{r['variant']:>32}  first shard {r.get('prepare_first_shard_s')} s  "
              f"then {r.get('prepare_clips_per_s_after_first')} clips/s  ({r.get('prepare_shards')} shards)")
    write_results(args.out, "prepare_e2e_smoke" if args.smoke else "prepare_e2e",
                  {"info": info, "rows": rows})
    if any(r["exit"] != 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
