"""Export a trained TAEHV in the published weight layout (.pth or .safetensors), plus `<out>.json`.

    taehv export runs/run1                         # its latest checkpoint to runs/run1/run1.safetensors
    taehv export runs/run1/checkpoints/step_00004000 --out taehv.pth --dtype fp32
    taehv export run1 --out taehv.pth --job-dir runs   # a run name under the job_dir

Load it with the published taehv.py (`TAEHV(checkpoint_path="taehv.pth")`) or
`taehv_slurm.trainer.model.load_published_weights`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from taehv_slurm.cli.conventions import add_job_dir, one_line_errors
from taehv_slurm.common.messages import command
from taehv_slurm.trainer.weights import DTYPES, ExportError, export_weights


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=command("export"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="a run folder, a checkpoints/step_N folder (or its state.pt), or a run name "
                        "under --job-dir")
    p.add_argument("--out", help="the weight file to write: NAME.pth or NAME.safetensors (default "
                                 "RUN/RUN.safetensors, inside the run folder)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp16",
                   help="stored dtype (default fp16, as the published demo runs)")
    add_job_dir(p)
    args = p.parse_args(argv)
    source = Path(args.source)
    if not source.exists() and (Path(args.job_dir) / args.source).exists():
        source = Path(args.job_dir) / args.source  # a run name, e.g. `run1` or `lr-sweep/lr=0.0001`
    try:
        done = export_weights(source, args.out, args.dtype)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported step {done.step} ({done.tensors} tensors, {done.parameters / 1e6:.2f} M parameters, "
          f"{done.dtype}) "
          f"to {done.weights}\nsidecar (config, step, sha256): {done.sidecar}")
    if done.published_shape:
        print("loads in the published taehv.py (the published model shape) or with "
              "taehv_slurm.trainer.model.load_published_weights")
    else:
        print("the model shape differs from the published TAEHV's (model.* in the sidecar): load it with "
              "taehv_slurm.trainer.model.load_published_weights, not the published taehv.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
