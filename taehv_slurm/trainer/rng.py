"""Every random stream a rank uses (Python, NumPy, torch CPU and CUDA), saved with a checkpoint and
restored at the same world size, so a resumed run draws exactly what the uninterrupted one would."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": torch.tensor(state, dtype=torch.int64), "python_version": version, "python_gauss": gauss,
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]), "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(rng: Mapping[str, Any]) -> None:
    random.setstate((rng["python_version"], tuple(int(v) for v in rng["python"].tolist()),
                     rng["python_gauss"]))
    np.random.set_state(("MT19937", rng["numpy"].numpy().astype(np.uint32), rng["numpy_pos"],
                         rng["numpy_has_gauss"], rng["numpy_gauss"]))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
