"""Training throughput of the real TAEHV step: clips/s per GPU, peak memory and MFU, by variant.

    python bench/train_throughput.py                      # single-GPU variants on the real shape
    python bench/train_throughput.py --gpus 2 --engines allreduce,zero1,zero2,zero3
    python bench/train_throughput.py --smoke              # CPU, tiny shapes: checks the script runs

One step = the trainer's own step (trainer.engine: encoder + decoder forward and backward through
DistillModule with latent and reconstruction losses, gradient all-reduce, AdamW) on a 12×480×720
clip batch already on the device (the loader is measured separately by bench/loader_throughput.py).
FLOPs per clip are counted from the model's layer shapes (forward; backward = 2× forward, minus the
input-gradient of the first convolution, which no one needs). MFU is against a bf16 matmul measured
on the same GPU at the start. Results: a table on stdout and JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import add_clip_shape, add_cudnn_benchmark, run_info, write_results  # noqa: E402
from taehv_slurm.trainer.engine import Microbatch, make_engine  # noqa: E402
from taehv_slurm.trainer.layers import FAST_PATHS  # noqa: E402
from taehv_slurm.trainer.losses import DistillModule  # noqa: E402
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, conv_flops_per_clip  # noqa: E402

VARIANTS = {
    # name: (channels_last, compile mode or None)
    "eager": (False, None),
    "eager_cl": (True, None),
    "compile": (False, "default"),
    "compile_cl": (True, "default"),
    "compile_cl_graphs": (True, "reduce-overhead"),
    "compile_cl_autotune": (True, "max-autotune-no-cudagraphs"),
}


def train_flops_per_clip(cfg: TAEHVConfig, frames: int, height: int, width: int) -> float:
    fwd = conv_flops_per_clip(cfg, frames, height, width)["total"]
    first = 2 * 3 * cfg.encoder_width * 9 * frames * height * width  # input conv: its input-grad is skipped
    return 3.0 * fwd - first


def bf16_peak_tflops(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    end.synchronize()
    return 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12


def measure(variant: str, engine_kind: str, batch: int, args: argparse.Namespace,
            device: torch.device) -> dict:
    channels_last, compile_mode = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = TAEHVConfig()
    student = TAEHV(cfg).to(device)
    if channels_last and device.type == "cuda":
        student.to(memory_format=torch.channels_last)
    module = DistillModule(student, latent_weight=1.0, reconstruction_weight=20.0)
    engine = make_engine(engine_kind, module, device, precision="bf16" if device.type == "cuda" else "fp32",
                         grad_clip=1.0, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, compile=False,
                         per_gpu_batch=batch, grad_accum=1)
    if compile_mode and engine_kind == "allreduce":
        engine.forward = torch.compile(module, mode=compile_mode)
    frames = torch.randint(0, 256, (batch, args.frames, 3, args.height, args.width), dtype=torch.uint8,
                           device=device)
    latents = torch.randn(batch, args.frames // 4, 16, args.height // 8, args.width // 8, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = [Microbatch(frames, latents, 1.0)]
    start = time.perf_counter()
    for _ in range(args.warmup):
        engine.train_step(step, 1e-4)
    sync()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        if dist.is_initialized():
            dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.train_step(step, 1e-4)
        sync()
        times.append((time.perf_counter() - start) / args.steps)
    step_s = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"variant": variant, "engine": engine_kind, "batch": batch, "step_s": step_s,
            "clips_per_s_per_gpu": batch / step_s, "peak_gib": peak, "warmup_s": warmup_s}


def profile(variant: str, batch: int, args: argparse.Namespace, device: torch.device, top: int = 25) -> None:
    """Where the time goes: CUDA kernel totals over 3 steps of one setting (after warm-up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    args_once = argparse.Namespace(**{**vars(args), "repeats": 1, "steps": 1})
    measure(variant, "allreduce", batch, args_once, device)  # warm (compile caches are reused)
    channels_last, compile_mode = VARIANTS[variant]
    torch.manual_seed(0)
    student = TAEHV(TAEHVConfig()).to(device)
    if channels_last:
        student.to(memory_format=torch.channels_last)
    module = DistillModule(student)
    engine = make_engine("allreduce", module, device, precision="bf16", grad_clip=1.0, lr=1e-4,
                         betas=(0.9, 0.95), weight_decay=0.01, compile=False, per_gpu_batch=batch,
                         grad_accum=1)
    if compile_mode:
        engine.forward = torch.compile(module, mode=compile_mode)
    frames = torch.randint(0, 256, (batch, args.frames, 3, args.height, args.width), dtype=torch.uint8,
                           device=device)
    latents = torch.randn(batch, args.frames // 4, 16, args.height // 8, args.width // 8, device=device)
    step = [Microbatch(frames, latents, 1.0)]
    for _ in range(2):
        engine.train_step(step, 1e-4)
    torch.cuda.synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(3):
            engine.train_step(step, 1e-4)
        torch.cuda.synchronize(device)
    print(f"\nprofile {variant} batch {batch} (3 steps), kernels:")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70))
    print("CUDA time per step by kind of kernel:")
    kinds: dict[str, float] = {}
    for e in prof.key_averages():
        # ("## Call CompiledFxGraph …" rows are annotations spanning a graph's kernels, not kernels)
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total \
                and not e.key.startswith("## "):
            kind = next((k for k in ("fprop", "dgrad", "wgrad") if k in e.key), None) or (
                "triton " + e.key.split("_")[1] if e.key.startswith("triton_") else "other")
            kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 3e3
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{ms:9.2f} ms  {kind}")
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"trace: {args.trace}")
    print("aten ops by CUDA time, with input shapes:")
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.self_device_time_total / 1e3:9.1f} ms  {e.count:4d}x  {e.key:34s} "
              f"{str(e.input_shapes)[:110]}")


def worker(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    rows = []
    for engine_kind in args.engines.split(","):
        for batch in map(int, args.batch.split(",")):
            row = measure(args.multi_variant, engine_kind, batch, args, device)
            row["gpus"] = world
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    """The command line, with --smoke's tiny sizes applied."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="eager,eager_cl,compile_cl")
    p.add_argument("--batch", default="4,8")
    p.add_argument("--gpus", type=int, default=1, help="world size for the engine comparison (spawned here)")
    p.add_argument("--engines", default="allreduce",
                   help="with --gpus > 1 or alone: allreduce,zero1,zero2,zero3")
    p.add_argument("--multi-variant", default="compile_cl", help="model variant used in the multi-GPU runs")
    add_clip_shape(p)
    add_cudnn_benchmark(p)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="CPU, 8×32×32 clips, eager only")
    p.add_argument("--profile", default=None, metavar="VARIANT:BATCH",
                   help="print the top CUDA kernels of one setting")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="with --profile: its Chrome trace, written here")
    p.add_argument("--fast", default=",".join(k for k, on in FAST_PATHS.items() if on),
                   help="model fast paths to enable (comma list, or 'none'); default: the model's defaults")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.frames, args.height, args.width, args.batch, args.variants = 8, 32, 32, "2", "eager"
        args.warmup, args.steps, args.repeats = 1, 1, 1
    return args


def measure_one_gpu(args: argparse.Namespace, device: torch.device, on_gpu: bool) -> list[dict]:
    """Every variant × engine × batch on `device`, in this process; out of memory is a row, not a failure."""
    if any(e != "allreduce" for e in args.engines.split(",")):
        # DeepSpeed needs a process group (and the launcher's variables) even for one rank
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        dist.init_process_group("nccl" if on_gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    for variant in args.variants.split(","):
        for engine_kind in args.engines.split(","):
            for batch in map(int, args.batch.split(",")):
                try:
                    row = measure(variant, engine_kind, batch, args, device)
                except torch.OutOfMemoryError:
                    row = {"variant": variant, "engine": engine_kind, "batch": batch,
                           "error": "out of memory"}
                    torch.cuda.empty_cache()
                row["gpus"] = 1
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def measure_many_gpus(args: argparse.Namespace) -> list[dict]:
    """--multi-variant with each engine and batch on --gpus spawned ranks; rank 0's rows."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        port = 29000 + os.getpid() % 1000
        mp.spawn(worker, args=(args.gpus, args, port, tmp.name), nprocs=args.gpus, join=True)
        return json.loads(Path(tmp.name).read_text())


def print_table(info: dict, flops: float, peak: float, rows: list[dict]) -> None:
    """The rows as a table on stdout, under the device, versions and the FLOP figures MFU is computed from."""
    print(f"\n{info['device']}, torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}; "
          f"{flops / 1e12:.2f} TFLOP per training clip; bf16 matmul {peak:.0f} TFLOP/s")
    print(f"{'gpus':>4} {'engine':>6} {'variant':>22} {'batch':>5} {'clips/s/GPU':>11} {'peak GiB':>8} "
          f"{'MFU':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['gpus']:>4} {r['engine']:>6} {r['variant']:>22} {r['batch']:>5} {r['error']:>11}")
        else:
            mfu = f"{100 * r['mfu']:.0f}%" if r.get("mfu") else "-"
            print(f"{r['gpus']:>4} {r['engine']:>6} {r['variant']:>22} {r['batch']:>5} "
                  f"{r['clips_per_s_per_gpu']:>11.1f} {r['peak_gib']:>8.1f} {mfu:>5}")


def main() -> None:
    args = parse_args()
    for name in FAST_PATHS:
        FAST_PATHS[name] = name in args.fast.split(",")
    on_gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        if args.cudnn_benchmark_limit is not None:
            torch.backends.cudnn.benchmark_limit = args.cudnn_benchmark_limit
    flops = train_flops_per_clip(TAEHVConfig(), args.frames, args.height, args.width)
    peak = bf16_peak_tflops(device) if on_gpu else float("nan")
    info = run_info(on_gpu, clip=[args.frames, args.height, args.width], train_tflop_per_clip=flops / 1e12,
                    bf16_matmul_tflops=peak, fast_paths=dict(FAST_PATHS),
                    cudnn_benchmark=args.cudnn_benchmark,
                    cudnn_benchmark_limit=torch.backends.cudnn.benchmark_limit if on_gpu else None)
    print(json.dumps(info), flush=True)
    rows = measure_one_gpu(args, device, on_gpu) if args.gpus == 1 else measure_many_gpus(args)
    if args.profile and on_gpu:
        variant, batch = args.profile.split(":")
        profile(variant, int(batch), args, device)
    for row in rows:
        if "clips_per_s_per_gpu" in row:
            row["mfu"] = row["clips_per_s_per_gpu"] * flops / 1e12 / peak if on_gpu else None
    print_table(info, flops, peak, rows)
    write_results(args.out, "train_throughput_smoke" if args.smoke else "train_throughput",
                  {"info": info, "rows": rows}, gpus=args.gpus)


if __name__ == "__main__":
    main()
