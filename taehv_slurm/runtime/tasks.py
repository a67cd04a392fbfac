"""Tasks named by their import path: the submitting side pickles a name and plain values, the rank
imports and builds the callable. So the driver never imports the trainer (nor torch), and a pickle
names one stable path instead of a class's whole module tree."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class TaskNotFoundError(ImportError):
    """MODULE:NAME does not name a callable; the message says which part is missing."""


def resolve(target: str) -> Callable[..., Any]:
    """'package.module:Name' → the object (a class or a function)."""
    module_name, sep, name = target.partition(":")
    if not sep or not module_name or not name:
        raise TaskNotFoundError(f"task {target!r}: expected MODULE:NAME, "
                                "e.g. taehv_slurm.trainer.task:TrainTask")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise TaskNotFoundError(f"task {target!r}: no module {err.name!r} here; "
                                "check the name and that the job's "
                                "python has the package installed") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise TaskNotFoundError(f"task {target!r}: module {module_name} has no {name!r}") from None


class TaskRef:
    """`TaskRef("taehv_slurm.trainer.task:TrainTask", train=..., runtime=...)`: on the rank, builds
    `TrainTask(train=..., runtime=...)` and calls it with the run context."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        self.target = target
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"TaskRef({self.target!r})"

    def build(self) -> Callable[..., Any]:
        return resolve(self.target)(**self.kwargs)

    def __call__(self, ctx: Any = None) -> Any:
        return self.build()(ctx)
