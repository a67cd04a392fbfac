"""Pickles of jobs queued under the old module names: until the next minor release.

Within version 0.1.0 the modules moved (top-level `trainer/` and flat `taehv_slurm/*.py` became
`taehv_slurm/trainer/` and `taehv_slurm/runtime/`). A job submitted before an update and started (or
requeued) after it holds a pickle that names
`trainer.train.TrainTask`, `taehv_slurm.requeue.RequeueableTask`, ... The entry point installs
`install()`'s finder before submitit loads the pickle: each old module name resolves to the module that
holds the class now, and an old `RequeueableTask` gets its backend object from the backend it ran on.
Nothing else sees these names (the finder is only installed in the job's own process), so a user's own
`trainer.py` is never shadowed outside it. Remove at the next minor release (0.2).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from typing import Any

from taehv_slurm.runtime.requeue import RequeueableTask as _RequeueableTask

# old module → the module that holds its pickled classes now
MODULES = {
    "trainer": "",  # a package of its own, holding only the aliases below
    "trainer.train": "taehv_slurm.trainer.task",
    "trainer.prepare": "taehv_slurm.trainer.prepare_task",
    "taehv_slurm.requeue": "taehv_slurm.runtime.legacy",
    "taehv_slurm.smoke": "taehv_slurm.runtime.smoke",
}


class RequeueableTask(_RequeueableTask):
    """An old pickle's RequeueableTask: its backend was the name in SUBMITIT_EXECUTOR, now an object."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "backend" not in state:
            from taehv_slurm.backends import backend_named  # the one place the rank side names a backend

            state["backend"] = backend_named(os.environ.get("SUBMITIT_EXECUTOR"))
        self.__dict__.update(state)


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        if spec.name == "trainer":  # an empty package of its own: nothing is set on taehv_slurm.trainer
            package = types.ModuleType("trainer")
            package.__path__ = []
            return package
        return importlib.import_module(MODULES[spec.name])

    def exec_module(self, module: Any) -> None:
        pass


def install() -> None:
    """Resolve the old module names in this process (before anything else can import them)."""
    if not any(isinstance(finder, _Aliases) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Aliases())
