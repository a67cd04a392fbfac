"""Throughput of data preparation: teacher clips/s per GPU, decode clips/s per CPU core, shard reads.

    python bench/prepare_throughput.py               # GPU: HunyuanVideo VAE, eager vs compile, batches 1,2,4
    python bench/prepare_throughput.py --batches 1,4,8 --modes eager
    python bench/prepare_throughput.py --smoke       # CPU, tiny sizes, seconds: checks the script runs

teacher  `Teacher.latents` (the path `jobs.prepare` runs) on uint8 windows already on the device: the encoder
         of HunyuanVideo's VAE in its default config (taehv_slurm/trainer/hunyuan_encoder.py) with random
         weights (the cost does not depend on the values), bf16, 16-frame windows of which the teacher
         encodes the first 13 (1 + 4k) at 480×720. Timed with CUDA events after warm-up (which includes
         compilation); peak memory per setting. "compile" is `Teacher.compile()`, what `jobs.prepare` does
         by default (static shapes, channels-last).
decode   `VideoFolderClips.read_window` (seek, decode, resize/crop) of 12-frame 720×480 windows from H.264
         files this script writes (moving synthetic scenes). Reported per CPU-second of the process (all
         its decoder threads), i.e. clips/s per core, and per wall second for one process.
read     `PreparedClips` items (frames + latents) from shards written with the worker's own writer,
         in a shuffled order; the files are fresh, so mostly from the page cache.
Results: a table on stdout and JSON under bench/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import run_info, write_results  # noqa: E402
from taehv_slurm.trainer.data import ClipSpec, SyntheticClips, VideoFolderClips  # noqa: E402
from taehv_slurm.trainer.hunyuan_encoder import EncoderSettings, HunyuanVideoEncoder  # noqa: E402
from taehv_slurm.trainer.manifest import FORMAT, Manifest  # noqa: E402
from taehv_slurm.trainer.prepared import PreparedClips  # noqa: E402
from taehv_slurm.trainer.shapes import teacher_frame_count  # noqa: E402
from taehv_slurm.trainer.shards import SHARD_DIR, shard_metadata, shard_path, verify, write_shard  # noqa: E402
from taehv_slurm.trainer.teacher import Teacher, load_teacher  # noqa: E402

GIB = 2**30


# ------------------------------------------------------------------------------------------- teacher


def default_hunyuan_encoder(device: torch.device) -> torch.nn.Module:
    """HunyuanVideo's VAE encoder (taehv_slurm/trainer/hunyuan_encoder.py), default config, random weights,
    built directly on `device`."""
    with torch.device(device):  # initialise on the GPU: 100 M parameters at CPU init speed take a while
        return HunyuanVideoEncoder(EncoderSettings())


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> tuple[float, float]:
    """(seconds per call after warm-up, seconds of the first call — compilation included)."""
    start = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(max(0, warmup - 1)):
        fn()
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / iters, first
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters, first


MODES = ("eager", "compile")


def teacher_in_mode(make_teacher: Callable[[], Teacher], mode: str) -> Teacher:
    """A fresh teacher, eager or compiled as `jobs.prepare` compiles it (`Teacher.compile`)."""
    teacher = make_teacher()
    if mode == "compile":
        teacher.compile()
    return teacher


def bench_teacher(make_teacher: Callable[[], Teacher], device: torch.device,
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for mode in args.modes.split(","):
        teacher = teacher_in_mode(make_teacher, mode)
        for batch in map(int, args.batches.split(",")):  # compiled: one compilation per batch shape
            row: dict[str, Any] = {"section": "teacher", "mode": mode, "batch": batch,
                                   "dtype": str(teacher_dtype(teacher)),
                                   "channels_last": teacher.channels_last,
                                   "window_frames": args.window_frames,
                                   "teacher_frames": teacher_frame_count(args.window_frames),
                                   "height": args.height, "width": args.width}
            frames = torch.randint(0, 256, (batch, args.window_frames, 3, args.height, args.width),
                                   dtype=torch.uint8, device=device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            try:
                per_call, first = time_calls(lambda frames=frames, latents=teacher.latents: latents(frames),
                                             device, args.warmup, args.iters)
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as err:  # e.g. a compiler failure: record it, measure the rest
                row["error"] = (f"{type(err).__name__}: "
                                f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}")[:200]
            else:
                row.update(seconds_per_batch=per_call, first_call_s=first, clips_per_s=batch / per_call)
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            del frames
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def profile_teacher(make_teacher: Callable[[], Teacher], device: torch.device,
                    args: argparse.Namespace) -> list[str]:
    """Where one teacher call's GPU time goes: the 30 most expensive ops (torch.profiler), as text rows."""
    mode, batch = args.profile.split(":")
    teacher = teacher_in_mode(make_teacher, mode)
    frames = torch.randint(0, 256, (int(batch), args.window_frames, 3, args.height, args.width),
                           dtype=torch.uint8, device=device)
    for _ in range(2):
        teacher.latents(frames)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=bool(args.trace)) as prof:
        teacher.latents(frames)
        torch.cuda.synchronize(device)
    if args.trace:  # each kernel with the op (and input shapes) that launched it
        prof.export_chrome_trace(args.trace)
    text = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
    print(text, flush=True)
    return text.splitlines()


def teacher_dtype(teacher: Teacher) -> torch.dtype:
    return next(teacher.encoder.parameters()).dtype


# -------------------------------------------------------------------------------------------- decode


def write_h264(path: Path, frames: np.ndarray, fps: int = 24, gop: int = 12) -> str:
    """frames: T×3×H×W uint8 → an H.264 file (MPEG-4 part 2 where this PyAV has no libx264)."""
    import av

    codec = "libx264"
    try:
        av.codec.Codec(codec, "w")
    except Exception:
        codec = "mpeg4"
    _, _, height, width = frames.shape
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps, options={"preset": "veryfast"} if codec == "libx264" else {})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        for k, frame in enumerate(frames):
            video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame.transpose(1, 2, 0)),
                                                     format="rgb24")
            video_frame.pts, video_frame.time_base = k, Fraction(1, fps)
            out.mux(stream.encode(video_frame))
        out.mux(stream.encode(None))
    return codec


def bench_decode(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    videos = folder / "videos"
    videos.mkdir()
    scenes = SyntheticClips(args.decode_videos,
                            ClipSpec(args.decode_video_frames, args.decode_height, args.decode_width), seed=1)
    codec = ""
    for i in range(args.decode_videos):
        codec = write_h264(videos / f"scene{i}.mp4", scenes[i]["frames"].numpy())
    clips = VideoFolderClips(videos, ClipSpec(args.decode_frames, args.decode_height, args.decode_width))
    order = list(range(len(clips))) * args.decode_rounds
    clips.read_window(0)  # open the codec once outside the timing
    wall, cpu = time.perf_counter(), time.process_time()
    for index in order:
        clips.read_window(index)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    row = {"section": "decode", "codec": codec, "windows": len(order), "frames": args.decode_frames,
           "height": args.decode_height, "width": args.decode_width, "wall_s": wall, "cpu_s": cpu,
           "clips_per_s": len(order) / wall, "clips_per_cpu_s": len(order) / cpu if cpu > 0 else None}
    print(json.dumps(row), flush=True)
    return row


# ---------------------------------------------------------------------------------------------- read


def bench_read(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Shards written by the worker's writer (random frames and latents), read through PreparedClips."""
    out = folder / "prepared"
    (out / SHARD_DIR).mkdir(parents=True)
    t, h, w = args.read_frames, args.read_height, args.read_width
    n, per_shard = args.read_clips, args.read_shard_size
    settings = {"data": str(folder / "none"), "frames": t, "height": h, "width": w, "stride": t,
                "shard_size": per_shard,
                "teacher_kind": "hunyuanvideo", "teacher_path": "random", "scaling_factor": None, "seed": 0}
    video = {"num_frames": n * t, "rate": "24", "time_base": "1/24", "start_pts": 0, "counted_by": "header"}
    manifest = Manifest(settings, {"synthetic.mp4": video}, [("synthetic.mp4", i * t) for i in range(n)],
                        created=time.time())
    manifest.write(out)
    generator = torch.Generator().manual_seed(0)
    for shard in range(manifest.num_shards):
        ids = list(manifest.shard_windows(shard))
        frames = torch.randint(0, 256, (len(ids), t, 3, h, w), dtype=torch.uint8, generator=generator)
        latents = torch.randn((len(ids), t // 4, 16, h // 8, w // 8), generator=generator).bfloat16()
        write_shard(shard_path(out, shard), {"frames": frames, "latents": latents},
                    shard_metadata(shard, ids, [manifest.windows[i] for i in ids], [], (t, h, w), 0.0, rank=0,
                                   job_id="bench"))
    report = verify(out)
    assert report.ok, report.table()
    data = PreparedClips(out, ClipSpec(t, h, w))
    order = list(range(len(data))) * args.read_rounds
    random.Random(0).shuffle(order)
    start = time.perf_counter()
    for index in order:
        item = data[index]
    seconds = time.perf_counter() - start
    mb = (item["frames"].numel() + 2 * item["latents"].numel()) / 1e6
    row = {"section": "read", "format": FORMAT, "clips": len(order), "frames": t, "height": h, "width": w,
           "shard_size": per_shard, "seconds": seconds, "clips_per_s": len(order) / seconds,
           "mb_per_s": len(order) * mb / seconds}
    print(json.dumps(row), flush=True)
    return row


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny sizes, the tiny random teacher: runs in seconds")
    p.add_argument("--modes", default="eager,compile",
                   help="teacher variants: eager and/or compile (as jobs.prepare compiles it)")
    p.add_argument("--batches", default="1,2,4", help="clips per teacher call")
    p.add_argument("--window-frames", type=int, default=16,
                   help="window length; the teacher encodes the first 4L−3 (16 → 13)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=720)
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per setting (the first compiles)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per setting")
    p.add_argument("--profile", metavar="MODE:BATCH",
                   help="also profile one teacher setting: its 30 most expensive CUDA ops go in the results")
    p.add_argument("--trace", default=None, metavar="PATH", help="with --profile: its Chrome trace, here")
    p.add_argument("--skip", default="", help="sections to skip: teacher, decode, read (comma-separated)")
    p.add_argument("--out",
                   help="JSON file for the results (default: bench/results/, named as _record.result_name)")
    args = p.parse_args(argv)
    if unknown := set(args.modes.split(",")) - set(MODES):
        p.error(f"--modes takes {' and '.join(MODES)}; got {', '.join(sorted(unknown))}")
    if args.profile and args.profile.split(":")[0] not in MODES:
        p.error(f"--profile takes MODE:BATCH with MODE {' or '.join(MODES)}; got {args.profile!r}")
    args.decode_videos, args.decode_video_frames, args.decode_rounds = 3, 48, 2
    args.decode_frames, args.decode_height, args.decode_width = 12, 480, 720
    args.read_clips, args.read_shard_size, args.read_rounds = 64, 32, 2
    args.read_frames, args.read_height, args.read_width = 12, 480, 720
    if args.smoke:
        args.modes, args.batches, args.window_frames, args.height, args.width = "eager", "1,2", 8, 64, 64
        args.warmup, args.iters = 1, 2
        args.decode_videos, args.decode_video_frames, args.decode_rounds = 2, 24, 1
        args.decode_frames, args.decode_height, args.decode_width = 8, 64, 64
        args.read_clips, args.read_shard_size, args.read_rounds = 8, 4, 1
        args.read_frames, args.read_height, args.read_width = 8, 64, 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    on_gpu = not args.smoke
    if on_gpu and not torch.cuda.is_available() and "teacher" not in skip:
        sys.exit("error: the teacher benchmark needs a CUDA GPU; run --smoke for the CPU check, "
                 "or --skip teacher")
    device = torch.device("cuda", 0) if on_gpu and torch.cuda.is_available() else torch.device("cpu")
    info = run_info(on_gpu=device.type == "cuda", smoke=args.smoke)
    rows: list[dict[str, Any]] = []
    if "teacher" not in skip:
        # the tiny random-weight teacher; the default-config VAE only built on meta (no memory)
        if args.smoke:
            def make_teacher() -> Teacher:
                return load_teacher("hunyuanvideo", "random:tiny")
            info["default_encoder_parameters"] = sum(p.numel() for p in
                                                 default_hunyuan_encoder(torch.device("meta")).parameters())
        else:
            torch.backends.cudnn.benchmark = True  # fixed shapes per setting: what jobs.prepare does too

            def make_teacher() -> Teacher:
                return Teacher(default_hunyuan_encoder(device)).to(device, torch.bfloat16)
            info["teacher_parameters"] = sum(p.numel() for p in default_hunyuan_encoder(torch.device("meta"))
                                             .parameters())
        rows += bench_teacher(make_teacher, device, args)
        if args.profile:
            info["profile"] = profile_teacher(make_teacher, device, args)
    with tempfile.TemporaryDirectory(prefix="prepare-bench-") as tmp:
        for section, run in (("decode", bench_decode), ("read", bench_read)):
            if section in skip:
                continue
            (Path(tmp) / section).mkdir()
            try:
                rows.append(run(Path(tmp) / section, args))
            except Exception as err:  # e.g. PyAV missing on the GPU image: keep the teacher's numbers
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                rows.append({"section": section, "error": f"{type(err).__name__}: {first}"[:200]})
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{info['device']}, torch {info['torch']}, CUDA {info['cuda']}")
    print(table(rows))
    write_results(args.out, "prepare_throughput_smoke" if args.smoke else "prepare_throughput",
                  {"info": info, "rows": rows})
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'section':<8} {'setting':<44} {'clips/s':>9} {'note'}"]
    for r in rows:
        if r["section"] != "teacher" and "error" in r:
            lines.append(f"{r['section']:<8} {'(failed)':<44} {'-':>9} {r['error']}")
            continue
        if r["section"] == "teacher":
            setting = (f"{r['mode']} {r['dtype'].replace('torch.', '')} batch {r['batch']}, "
                       f"{r['teacher_frames']}/{r['window_frames']}×{r['height']}×{r['width']}")
            rate = f"{r['clips_per_s']:.2f}" if "clips_per_s" in r else r.get("error", "-")
            note = (f"{1e3 * r['seconds_per_batch']:.0f} ms/batch, first call {r['first_call_s']:.1f} s"
                    if "seconds_per_batch" in r else "")
            if "peak_gib" in r:
                note += f", peak {r['peak_gib']:.1f} GiB"
        elif r["section"] == "decode":
            setting = f"{r['codec']} {r['frames']}×{r['height']}×{r['width']} windows, 1 process"
            rate = f"{r['clips_per_s']:.2f}"
            per_core = r["clips_per_cpu_s"]
            note = f"{per_core:.2f} clips per CPU-second (per core)" if per_core else ""
        else:
            setting = f"PreparedClips {r['frames']}×{r['height']}×{r['width']}, shards of {r['shard_size']}"
            rate = f"{r['clips_per_s']:.1f}"
            note = f"{r['mb_per_s']:.0f} MB/s, shuffled, page cache warm"
        lines.append(f"{r['section']:<8} {setting:<44} {rate:>9} {note}")
    return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
