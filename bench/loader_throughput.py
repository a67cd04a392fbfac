"""The training loader's throughput: clips/s delivered by `trainer.data.step_batches` with W workers, from
raw H.264 videos (decoded on the CPU with PyAV) and from prepared shards (uint8 frames + bf16 latents).

    python bench/loader_throughput.py [--workers 1,2,4,8] [--seconds 8]
    python bench/loader_throughput.py --smoke      # CPU, tiny: checks the script runs

The trainer's goal is 63 clips/s per GPU, 504 per 8-GPU node: a source keeps up when W workers per GPU
deliver ≥ 63 clips/s. Decode clips/s per core sets `DECODE_CLIPS_PER_CORE` in taehv_slurm/plan.py.
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
from bench.prepare_throughput import write_h264  # noqa: E402
from trainer.data import ClipSpec, GlobalOrder, SyntheticClips, VideoFolderClips, step_batches  # noqa: E402
from trainer.prepare import shard_metadata, shard_path, write_shard  # noqa: E402

GOAL_PER_GPU = 63.0


def delivered(source, workers: int, batch: int, seconds: float) -> float:
    """Clips/s from step_batches (one rank, `batch` per micro-batch) after the first batch arrives."""
    batches = step_batches(source, GlobalOrder(len(source), 0), 0, batch, 1, 1, 0, num_workers=workers,
                           prefetch_factor=4)
    next(batches)  # workers started, first batch decoded
    start, clips = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        _, micro = next(batches)
        clips += sum(len(m["index"]) for m in micro)
    rate = clips / (time.perf_counter() - start)
    batches.close()
    return rate


def make_videos(folder: Path, spec: ClipSpec, videos: int, frames: int) -> None:
    scenes = SyntheticClips(videos, ClipSpec(frames, spec.height, spec.width), seed=3)
    folder.mkdir(parents=True)
    for i in range(videos):
        write_h264(folder / f"v{i:03d}.mp4", scenes[i]["frames"].numpy())  # T×3×H×W uint8


def make_shards(folder: Path, spec: ClipSpec, clips: int, per_shard: int) -> None:
    """Shards in the format `jobs.prepare` writes (random content; reading speed does not depend on it)."""
    (folder / "shards").mkdir(parents=True)
    lat = (spec.frames // 4, 16, spec.height // 8, spec.width // 8)
    for shard in range(clips // per_shard):
        ids = list(range(shard * per_shard, (shard + 1) * per_shard))
        tensors = {"frames": torch.randint(0, 256, (per_shard, spec.frames, 3, spec.height, spec.width), dtype=torch.uint8),
                   "latents": torch.randn(per_shard, *lat).to(torch.bfloat16)}
        write_shard(shard_path(folder, shard), tensors, shard_metadata(shard, ids, [("v.mp4", i) for i in ids], []))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = ClipSpec(8, 64, 64) if args.smoke else ClipSpec(12, 480, 720)
    workers = [0, 1] if args.smoke else [int(w) for w in args.workers.split(",")]
    seconds = 1.0 if args.smoke else args.seconds
    info = run_info(on_gpu=False, clip=list(vars(spec).values()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_videos(root / "videos", spec, 4 if args.smoke else 8, spec.frames * (3 if args.smoke else 10))
        video = VideoFolderClips(root / "videos", spec)
        try:
            from trainer.prepared import PreparedClips

            make_shards(root / "prepared", spec, 8 if args.smoke else 64, 4 if args.smoke else 16)
            prepared = PreparedClips(root / "prepared", spec)
        except Exception as err:  # the shard format is checked by tests/test_prepare.py; report and go on
            print(f"prepared shards skipped: {err}")
            prepared = None
        for name, source in (("video", video), ("prepared", prepared)):
            if source is None:
                continue
            for w in workers:
                rate = delivered(source, w, 2 if args.smoke else 8, seconds)
                per_worker = rate / max(w, 1)
                row = {"source": name, "workers": w, "clips_per_s": round(rate, 1), "clips_per_s_per_worker": round(per_worker, 2),
                       "workers_per_gpu_for_goal": round(GOAL_PER_GPU / per_worker, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{info['cores']} cores, clips {spec.frames}×{spec.height}×{spec.width}; goal {GOAL_PER_GPU:.0f} clips/s per GPU")
    print(f"{'source':>9} {'workers':>7} {'clips/s':>8} {'per worker':>10} {'workers/GPU for goal':>21}")
    for r in rows:
        print(f"{r['source']:>9} {r['workers']:>7} {r['clips_per_s']:>8} {r['clips_per_s_per_worker']:>10} {r['workers_per_gpu_for_goal']:>21}")
    write_results(args.out, f"loader_throughput{'_smoke' if args.smoke else ''}.json", {"info": info, "rows": rows})


if __name__ == "__main__":
    main()
