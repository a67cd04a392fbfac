"""Goodput at scale, on paper: the effective training time ratio (ETTR) this design gives at 64, 512 and
4096 GPUs under Llama 3's failure rate, from the figures measured here, with a fault answered by a requeue
(the job waits in the queue again) or by a restart inside the allocation the job holds (spare nodes), and
the checkpoint interval the plan uses at each size (`intervals.ckpt_every: auto`,
taehv_slurm.common.plan.checkpoint_interval_s).

    python bench/goodput_model.py [--save-s 0.5] [--queue-wait-s 1800] [--requeue-s 20] [--restart-s 10]
                                  [--first-step-s 20] [--detect-s 65] [--spare-nodes 1]

Per interruption the job loses half a checkpoint interval of work on average, the way back — a requeue
(`--requeue-s`, Slurm's own restart, plus `--queue-wait-s` in a busy queue) or a restart inside the
allocation (`--restart-s`) — the time to its first step (start-up, restore, compilation), and for a hang the
time to detect it; every checkpoint costs its save. With M the job's mean time between interruptions and tau
the interval: ETTR = 1 - save/tau - (tau/2 + way back + first_step + hang_share * detect) / M. Spare nodes
are held all the time: the restart's ETTR is over the nodes trained on plus the spares (8 GPUs a node).
Preemptions and time limits are not counted: every rank saves at the signal, so they lose no work (only the
way back).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import RESULTS, code_version, result_name  # noqa: E402
from taehv_slurm.common.plan import GPU_SECONDS_PER_INTERRUPTION, checkpoint_interval_s  # noqa: E402

SIZES = (64, 512, 4096)
GPUS_PER_NODE = 8


def ettr(gpus: int, interval_s: float, save_s: float, way_back_s: float, first_step_s: float, detect_s: float,
         hang_share: float) -> tuple[float, float]:
    """(ETTR over the nodes trained on, the job's mean time between interruptions in seconds) at `gpus`."""
    mtbf = GPU_SECONDS_PER_INTERRUPTION / gpus
    lost_per_failure = interval_s / 2 + way_back_s + first_step_s + hang_share * detect_s
    return 1 - save_s / interval_s - lost_per_failure / mtbf, mtbf


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save-s", type=float, default=0.5,
                   help="one checkpoint save (measured: docs/benchmarks.md)")
    p.add_argument("--queue-wait-s", type=float, default=1800.0,
                   help="a requeued job's wait in a busy queue (0: an idle cluster)")
    p.add_argument("--requeue-s", type=float, default=20.0,
                   help="Slurm's requeue to running again on an idle cluster (testbed: 10-20 s)")
    p.add_argument("--restart-s", type=float, default=10.0,
                   help="a restart inside the allocation, fault found to ranks started (testbed: 1-3 s)")
    p.add_argument("--first-step-s", type=float, default=20.0, help="start to first step, warm compile cache")
    p.add_argument("--detect-s", type=float, default=65.0,
                   help="a hang's detection: the 60 s floor + a heartbeat")
    p.add_argument("--hang-share", type=float, default=0.3,
                   help="interruptions that are hangs (the rest crash)")
    p.add_argument("--spare-nodes", type=int, default=1, help="spare nodes held for restarts")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file, or a folder for goodput_model_cpu_<date>_<commit>.json (default: "
                        "bench/results/)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": "cpu", **code_version()}
    out = args.out or RESULTS
    if out.is_dir():
        out = out / result_name("goodput_model", info)
    rows = []
    for gpus in SIZES:
        interval = checkpoint_interval_s(gpus, args.save_s)
        common = (args.save_s, args.first_step_s, args.detect_s, args.hang_share)
        requeued, mtbf = ettr(gpus, interval, args.save_s, args.queue_wait_s + args.requeue_s, *common[1:])
        idle_queue, _ = ettr(gpus, interval, args.save_s, args.requeue_s, *common[1:])
        inside, _ = ettr(gpus, interval, args.save_s, args.restart_s, *common[1:])
        hourly, _ = ettr(gpus, 3600.0, args.save_s, args.queue_wait_s + args.requeue_s, *common[1:])
        nodes = gpus // GPUS_PER_NODE
        rows.append({"gpus": gpus, "mtbf_h": round(mtbf / 3600, 1),
                     "interruptions_per_day": round(86400 / mtbf, 2),
                     "checkpoint_interval_min": round(interval / 60, 1), "ettr": round(requeued, 4),
                     "ettr_idle_queue": round(idle_queue, 4),
                     "ettr_restart_in_allocation": round(inside * nodes / (nodes + args.spare_nodes), 4),
                     "ettr_hourly_checkpoints": round(hourly, 4)})
    print(f"| GPUs | mean time between interruptions | interruptions/day | checkpoint every | ETTR, requeue "
          f"({args.queue_wait_s / 60:.0f} min queue) | ETTR, requeue (idle queue) | ETTR, restart in the "
          f"allocation ({args.spare_nodes} spare node) | ETTR, requeue, hourly checkpoints |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['mtbf_h']} h | {r['interruptions_per_day']} | "
              f"{r['checkpoint_interval_min']} min | {100 * r['ettr']:.2f} % | "
              f"{100 * r['ettr_idle_queue']:.2f} % | "
              f"{100 * r['ettr_restart_in_allocation']:.2f} % | {100 * r['ettr_hourly_checkpoints']:.2f} % |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "inputs": {k: v for k, v in vars(args).items() if k != "out"},
                               "gpu_seconds_per_interruption": round(GPU_SECONDS_PER_INTERRUPTION),
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(math.isfinite(r["ettr"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
