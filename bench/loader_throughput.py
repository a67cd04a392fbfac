"""The training loader's throughput: clips/s delivered by `trainer.data.microbatches` with W workers, from
raw H.264 videos (decoded on the CPU with PyAV), prepared shards (uint8 frames + bf16 latents) and
synthetic clips (rendered with numpy).

    python bench/loader_throughput.py [--workers 1,2,4,8] [--seconds 8]
    python bench/loader_throughput.py --smoke      # CPU, tiny: checks the script runs

Clips/s per worker at 8 workers sets `CLIPS_PER_WORKER` in taehv_slurm/common/plan.py (the plan gives each
rank enough workers to deliver the trainer's TRAIN_CLIPS_PER_GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import run_info, write_results  # noqa: E402
from bench.e2e_throughput import local_cluster, prepare_data  # noqa: E402
from taehv_slurm.common.plan import TRAIN_CLIPS_PER_GPU  # noqa: E402
from taehv_slurm.trainer.data import ClipSpec, GlobalOrder, SyntheticClips, VideoFolderClips, microbatches  # noqa: E402
from taehv_slurm.trainer.prepared import PreparedClips  # noqa: E402

GOAL_PER_GPU = TRAIN_CLIPS_PER_GPU


def delivered(source, workers: int, batch: int, seconds: float) -> float:
    """Clips/s from the trainer's loader (one rank, `batch` per micro-batch) after the first batch arrives."""
    batches = microbatches(source, GlobalOrder(len(source), 0), 0, batch, 0, [batch], num_workers=workers,
                           prefetch_factor=4)
    next(batches)  # workers started, first batch loaded
    start, clips = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        clips += len(next(batches)["index"])
    rate = clips / (time.perf_counter() - start)
    batches.close()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--work", default="/tmp/taehv-e2e",
                   help="videos and prepared shards (bench/e2e_throughput.py's)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = ClipSpec(8, 64, 64) if args.smoke else ClipSpec(12, 480, 720)
    workers = [0, 1] if args.smoke else [int(w) for w in args.workers.split(",")]
    seconds = 1.0 if args.smoke else args.seconds
    info = run_info(on_gpu=torch.cuda.is_available() and not args.smoke, clip=list(vars(spec).values()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) if args.smoke else Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        on_gpu = torch.cuda.is_available() and not args.smoke
        cluster = local_cluster(work, on_gpu, 1 if args.smoke else 12)
        # The real data path: H.264 files, and the shards `jobs.prepare` writes from them.
        prepared = prepare_data(work, spec, 4 if args.smoke else 48, spec.frames * 3,
                                cluster, args.smoke, 900)
        sources = {"video": VideoFolderClips(work / "videos", spec),
                   "prepared": PreparedClips(prepared, spec),
                   "synthetic": SyntheticClips(4096, spec)}
        for name, source in sources.items():
            for w in workers:
                rate = delivered(source, w, 2 if args.smoke else 4, seconds)
                per_worker = rate / max(w, 1)
                row = {"source": name, "workers": w, "clips_per_s": round(rate, 1),
                       "clips_per_s_per_worker": round(per_worker, 2),
                       "workers_per_gpu_for_goal": round(GOAL_PER_GPU / per_worker, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{info['cores']} cores, clips {spec.frames}×{spec.height}×{spec.width}; "
          f"goal {GOAL_PER_GPU:.0f} clips/s per GPU")
    print(f"{'source':>9} {'workers':>7} {'clips/s':>8} {'per worker':>10} {'workers/GPU for goal':>21}")
    for r in rows:
        print(f"{r['source']:>9} {r['workers']:>7} {r['clips_per_s']:>8} {r['clips_per_s_per_worker']:>10} "
              f"{r['workers_per_gpu_for_goal']:>21}")
    write_results(args.out, "loader_throughput_smoke" if args.smoke else "loader_throughput",
                  {"info": info, "rows": rows})


if __name__ == "__main__":
    main()
