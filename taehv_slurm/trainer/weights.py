"""Export a trained student as the file people use: the published TAEHV weight layout.

    taehv export runs/run1 --out taehv.safetensors      # or .pth; a run, a step folder or a run name

The checkpoint already holds the student's full tensors by parameter name, and those names are the
published file's keys (`encoder.<i>.…` / `decoder.<i>.…`), for every engine and world size — so the
export is the same file whatever trained it. Next to the weights goes a sidecar, `<out>.json`: the
run's train config and model shape, the step, the engine and world size that trained it, and the
weight file's sha256.

The published `taehv.py` loads a `.pth` with `torch.load(..., weights_only=True)` and
`load_state_dict`, which casts to the model's dtype; its demo runs the model in fp16, the default here.
`taehv_slurm.trainer.model.load_published_weights` reads both formats.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from taehv_slurm.common.runfolder import RunFolder, write_text_atomic
from taehv_slurm.runtime.checkpoint import Checkpointer, nonfinite_tensors
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FORMATS = (".pth", ".safetensors")


class ExportError(ValueError):
    """The source or the output of an export is not usable; the message names the fix."""


@dataclass(frozen=True)
class Exported:
    weights: Path
    sidecar: Path
    step: int
    dtype: str
    tensors: int
    parameters: int
    published_shape: bool  # the published TAEHV's shape: madebyollin's taehv.py loads the file as it is


def checkpoint_of(source: str | os.PathLike) -> tuple[Checkpointer, int]:
    """(checkpoints folder, step) for a run folder (its latest checkpoint), a `checkpoints/` folder,
    a `step_N` folder or its `state.pt`."""
    path = Path(source)
    if path.name == "state.pt":
        path = path.parent
    if path.name.startswith("step_") and (path / "meta.json").is_file():
        return (Checkpointer(path.parent, trust_root=path.parent),
                int(path.name.removeprefix("step_").split(".")[0]))
    for folder in (RunFolder(path).checkpoints, path):
        checkpoints = Checkpointer(folder, trust_root=folder)
        step = checkpoints.latest_step()
        if step is not None:
            return checkpoints, step
    if not path.exists():
        raise ExportError(f"{source}: no such run or checkpoint; give a run folder (e.g. runs/NAME), "
                          "one of its checkpoints/step_N folders, or a run name with --job-dir")
    raise ExportError(f"{source}: holds no saved checkpoint yet (no checkpoints/step_N with meta.json); "
                      "export after the run saved one (intervals.ckpt_every, or at its end)")


def published_state_dict(params: dict[str, torch.Tensor], model_fields: dict[str, Any],
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The student's tensors in the published key order and `dtype`, checked against the model shape."""
    expected = TAEHV(TAEHVConfig.from_dict(model_fields)).state_dict()
    missing, extra = expected.keys() - params.keys(), params.keys() - expected.keys()
    if missing or extra:
        raise ExportError(f"the checkpoint's parameters do not match a TAEHV of {model_fields} (missing "
                          f"{sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}); "
                          "was it written by taehv_slurm.trainer?")
    for name, ref in expected.items():
        if params[name].shape != ref.shape:
            raise ExportError(f"the checkpoint's {name} has shape {tuple(params[name].shape)}, a TAEHV of "
                              f"{model_fields} has {tuple(ref.shape)}")
    return {name: params[name].detach().to(dtype).contiguous() for name in expected}


def export_weights(source: str | os.PathLike, out: str | os.PathLike | None = None,
                   dtype: str = "fp16") -> Exported:
    """Write the student of `source`'s checkpoint to `out` (.pth or .safetensors; default
    `<run>/<run>.safetensors` in its run folder) and `<out>.json`."""
    out = Path(out) if out else RunFolder.of(source).export
    if out.suffix not in FORMATS:
        raise ExportError(f"--out {out}: name the file .pth (torch) or .safetensors")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: folder {out.parent} does not exist; create it or pick another path")
    checkpoints, step = checkpoint_of(source)
    step, state, meta = checkpoints.load(step)
    if bad := nonfinite_tensors(state["params"]):
        raise ExportError(f"checkpoint step {step} holds non-finite weights ({len(bad)} tensor(s), e.g. "
                          f"{bad[0]}): the run diverged; export an earlier checkpoint (its "
                          "checkpoints/step_N folder)")
    weights = published_state_dict(state["params"], meta["model"], DTYPES[dtype])

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(weights, str(tmp), metadata={"format": "pt"})
        else:
            with open(tmp, "wb") as f:  # a file object: the archive is named "archive", not after the file
                torch.save(weights, f)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()  # ~45 MB at most (fp32)
        os.chmod(tmp, 0o644)  # weights to share, as the sidecar (safetensors writes 0600 itself, torch 0644)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    sidecar = out.with_name(out.name + ".json")
    info = {"weights": out.name, "sha256": digest, "format": out.suffix[1:], "dtype": dtype, "step": step,
            "model": meta["model"], "engine": meta.get("engine"), "world_size": meta.get("world_size"),
            "checkpoint": str(checkpoints.directory.resolve() / f"step_{step:08d}"),
            "config": meta.get("config")}
    write_text_atomic(sidecar, json.dumps(info, indent=1) + "\n", 0o644)
    published = TAEHVConfig.from_dict(meta["model"]) == TAEHVConfig()
    return Exported(out, sidecar, step, dtype, len(weights), sum(t.numel() for t in weights.values()),
                    published)
