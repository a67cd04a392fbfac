"""Save-at-signal on real GPUs: SIGTERM to every rank mid-training → seconds until all saved and exited;
checkpoint save time against step time (sync and async); then resume on fewer GPUs.

    python bench/requeue_signal.py --gpus 2 [--resume-gpus 1] [--steps 30] [--signal-at 15]
    python bench/requeue_signal.py --smoke      # CPU, tiny: checks the script runs

Each rank is a process started like torchrun (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*) running the trainer's
own `RequeueableTask(TrainTask(...))` on the real 12×480×720 config (synthetic clips, no teacher), so the
path measured is the one a Slurm job takes: signal → flag → agreed at the step boundary → every rank
saves → exit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from taehv_slurm.common.runfolder import RunFolder  # noqa: E402

WORKER = """
import sys, json
from taehv_slurm.runtime.requeue import RequeueableTask
from taehv_slurm.trainer.task import TrainTask
train, runtime, run_dir = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
RequeueableTask(TrainTask(train, runtime), run_dir, signal_delay_s=120, kill_wait_s=30)()
"""


def launch(world: int, train: dict, runtime: dict, run_dir: Path, port: int,
           log: Path) -> list[subprocess.Popen]:
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
        with open(log.with_suffix(f".rank{rank}.log"), "w") as out:  # the child keeps its own handle
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(train),
                                           json.dumps(runtime), str(run_dir)],
                                          env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in RunFolder(run_dir).metrics().read() if "loss" in r]
    return steps[-1] if steps else 0


def events(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in RunFolder(run_dir).events().read() if r["event"] == kind]


def parse_args() -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--resume-gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--signal-at", type=int, default=15)
    p.add_argument("--ckpt-every", type=int, default=5,
                   help="periodic checkpoints, to time sync and async saves")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   help="torch.compile the model (optionally with a mode, e.g. reduce-overhead)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args()


def train_config(args: argparse.Namespace, on_gpu: bool, frames: int, height: int, width: int) -> dict:
    """The trainer's config: the real clip shape on GPUs (synthetic clips, no teacher); tiny on the CPU."""
    return {"name": "signal-bench", "steps": args.steps, "seed": 0,
            "data": {"source": "synthetic", "num_clips": 4096, "frames": frames, "height": height,
                     "width": width, "val_clips": 2, "num_workers": args.workers if on_gpu else 0},
            "model": {} if on_gpu else {"encoder_width": 8, "decoder_widths": [16, 8, 8, 8]},
            "batch": {"effective": 16 if on_gpu else 4, "per_gpu": 8 if on_gpu else 2},
            "engine": {"kind": "allreduce", "compile": args.compile is not None,
                       "compile_mode": args.compile or "default", "precision": "bf16" if on_gpu else "fp32"},
            "intervals": {"log_every": 1, "val_every": 10_000, "ckpt_every": args.ckpt_every,
                          "keep_checkpoints": 2}}


def signal_run(mode: str, args: argparse.Namespace, base: dict, runtime: dict, tmp_path: Path) -> dict:
    """Train with `mode` (sync or async) checkpoints; SIGTERM all ranks at --signal-at; time the save."""
    run_dir = tmp_path / f"run-{mode}"
    train = {**base, "intervals": {**base["intervals"], "async_checkpoint": mode == "async"}}
    port = 20000 + os.getpid() % 5000 + (0 if mode == "sync" else 7)
    procs = launch(args.gpus, train, runtime, run_dir, port, tmp_path / f"{mode}.log")
    deadline = time.monotonic() + 600
    while last_step(run_dir) < args.signal_at and time.monotonic() < deadline:
        if any(pr.poll() is not None for pr in procs):
            break
        time.sleep(0.05)
    signalled = time.time()
    for pr in procs:
        pr.send_signal(signal.SIGTERM)
    for pr in procs:
        pr.wait(timeout=120)
    exited = time.time()
    requeue = events(run_dir, "exited_for_restart")  # no scheduler here: the ranks save and exit
    log0 = (tmp_path / f"{mode}.rank0.log").read_text()
    saved = r"checkpoint step \d+ (?:saved|handed to the writer) in ([\d.]+) s"
    saves = [float(s) for s in re.findall(saved, log0)]
    times = [r["time"] for r in RunFolder(run_dir).metrics().read() if "loss" in r]
    step_s = (times[-1] - times[2]) / max(1, len(times) - 3) if len(times) > 4 else float("nan")
    return {
        "gpus": args.gpus, "saved_step": requeue[0]["step"] if requeue else None,
        "signal_to_saved_s": requeue[0]["signal_to_saved_s"] if requeue else None,
        "signal_to_all_exited_s": round(exited - signalled, 3),
        "exit_codes": [pr.returncode for pr in procs],
        "periodic_save_s": saves[:-1], "signal_save_s": saves[-1] if saves else None,
        "step_s": round(step_s, 4),
        "save_fraction_of_step": (round(sum(saves[:-1]) / len(saves[:-1]) / step_s, 3)
                                  if len(saves) > 1 else None),
    }


def resume_run(args: argparse.Namespace, base: dict, runtime: dict, tmp_path: Path) -> dict:
    """Resume the sync run on --resume-gpus for 3 more steps: same effective batch, more accumulation."""
    run_dir = tmp_path / "run-sync"
    resumed_from = last_step(run_dir)
    train = {**base, "steps": resumed_from + 3}
    port = 20000 + os.getpid() % 5000 + 13
    procs = launch(args.resume_gpus, train, runtime, run_dir, port, tmp_path / "resume.log")
    codes = [pr.wait(timeout=900) for pr in procs]
    start = events(run_dir, "start")[-1]
    return {"gpus": args.resume_gpus, "exit_codes": codes, "from_step": start["step"],
            "grad_accum": start["grad_accum"], "effective_batch": start["effective_batch"],
            "final_step": last_step(run_dir)}


def main() -> None:
    args = parse_args()
    import torch

    from bench._record import run_info, write_results

    on_gpu = torch.cuda.is_available() and not args.smoke
    frames, height, width = (12, 480, 720) if on_gpu else (8, 32, 32)
    base = train_config(args, on_gpu, frames, height, width)
    runtime = {"device": "cuda" if on_gpu else "cpu", "torch_threads": 4 if on_gpu else 1,
               "rendezvous_timeout_s": 120}
    results = run_info(on_gpu, clip=[frames, height, width], per_gpu_batch=base["batch"]["per_gpu"])
    tmp_path = Path(tempfile.mkdtemp(prefix="signal-bench-"))  # kept: the rank logs are worth reading
    print(f"rank logs: {tmp_path}")
    for mode in ("sync", "async"):
        results[mode] = signal_run(mode, args, base, runtime, tmp_path)
        print(json.dumps({mode: results[mode]}), flush=True)
    results["resume"] = resume_run(args, base, runtime, tmp_path)
    print(json.dumps({"resume": results["resume"]}), flush=True)
    if any(results["resume"]["exit_codes"]):
        print((tmp_path / "resume.rank0.log").read_text()[-3000:])
    write_results(args.out, "requeue_signal_smoke" if args.smoke else "requeue_signal", results,
                  gpus=args.gpus)


if __name__ == "__main__":
    main()
