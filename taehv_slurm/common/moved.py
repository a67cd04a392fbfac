"""Modules that moved, under their old names, until the next minor release (0.2).

The shared layer moved into `taehv_slurm/common/` and a few modules were renamed so that no two layers hold
a module of the same name, and no module shares a package's name. A user's `from taehv_slurm.config import
load_cluster`, and a job pickled before an update and started (or requeued) after it, still name the old
modules: `install()` (run by `import taehv_slurm`) resolves each old name to the module now holding its
code — the same module object, not a copy. Only names under `taehv_slurm.` resolve here, so nothing of the
user's is shadowed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any

MOVED = {
    **{f"taehv_slurm.{name}": f"taehv_slurm.common.{name}"
       for name in ("config", "changes", "plan", "messages", "security", "machine", "train_config",
                    "typed_yaml", "submitit_api")},
    "taehv_slurm.runtime.runfiles": "taehv_slurm.common.runfolder",
    "taehv_slurm.checks": "taehv_slurm.submit_checks",
    "taehv_slurm.preflight": "taehv_slurm.preflight_checks",
    "taehv_slurm.trainer.checks": "taehv_slurm.trainer.data_checks",
    "taehv_slurm.trainer.prepare": "taehv_slurm.trainer.prepare_task",
    "taehv_slurm.trainer.export": "taehv_slurm.trainer.weights",
    "taehv_slurm.runtime.backend": "taehv_slurm.runtime.rank_backend",
    "taehv_slurm.cli.common": "taehv_slurm.cli.conventions",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An old name → the module at its new name (imported there first)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets the old name's spec on it next
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # its own spec back


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
