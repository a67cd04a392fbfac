"""What changed in a run's training config between attempts, and which changes a resume can take.

A run resumed with other values continues from its checkpoint. Most values may change mid-run (steps,
intervals, lr, batch split, engine); some would make the checkpoint another model's or change what it
learns from (the model's shape, the teacher): those are refused, naming the two ways out. Used on the
login node before submitting (taehv_slurm.submit_checks) and by the trainer when it loads a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The weights' shapes (TrainConfig.model_fields) and the distillation target.
REFUSED_KEYS = ("model.latent_channels", "model.patch_size", "model.encoder_width", "model.decoder_widths",
                "teacher.kind", "teacher.path", "teacher.scaling_factor")
SCHEDULE_NOTE = "the lr schedule is recomputed for the new value from the resumed step on"
ORDER_NOTE = "the clips of each step from the resumed step on differ from an uninterrupted run's"
NOTES = {
    "steps": SCHEDULE_NOTE, "optim.lr": SCHEDULE_NOTE, "optim.warmup_steps": SCHEDULE_NOTE,
    "optim.lr_scaling": SCHEDULE_NOTE, "optim.reference_batch": SCHEDULE_NOTE,
    "optim.min_lr_ratio": SCHEDULE_NOTE,
    "batch.effective": ORDER_NOTE, "seed": ORDER_NOTE,
    "data.source": "the run continues on other data", "data.path": "the run continues on other data",
    "model.init_from": "not used on resume: the checkpoint's weights are loaded",
}


@dataclass(frozen=True)
class Change:
    key: str  # dotted, e.g. "optim.lr"
    old: Any
    new: Any

    @property
    def refused(self) -> bool:
        return self.key in REFUSED_KEYS

    @property
    def note(self) -> str:
        return NOTES.get(self.key, "")

    def line(self) -> str:
        """'optim.lr: 0.001 → 0.002 (the lr schedule is ...)' — one line for the user."""
        note = f" ({self.note})" if self.note else ""
        return f"{self.key}: {self.old!r} → {self.new!r}{note}"

    def refusal(self, where: str) -> str:
        return (f"{self.key}: {where} was trained with {self.old!r}, the config now says {self.new!r}; "
                f"set it back (--set {self.key}={_as_set(self.old)}) or start a new run (another --name)")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} → {"optim.lr": 1}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Every key whose value differs between two training configs (as `TrainConfig.to_dict()` gives them);
    a key only one of them has (a config of an older release) is left out."""
    before, after = flatten(old), flatten(new)
    return [Change(k, before[k], after[k]) for k in after if k in before and before[k] != after[k]]


def refusals(saved: Mapping[str, Any], new: Mapping[str, Any], where: str) -> list[str]:
    """One line per change a checkpoint trained with `saved` cannot resume under (`where` names it)."""
    return [c.refusal(where) for c in config_changes(saved, new) if c.refused]


def _as_set(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return "null" if value is None else str(value)
