"""Name the part of a task that cannot be pickled, before submitit fails deep inside `submit`.

submitit writes the task into the job folder with cloudpickle (functions and classes of a notebook
travel by value). When one attribute cannot travel — a lock, an open file, a socket, a generator, a
database connection — cloudpickle's error names only the type ("cannot pickle '_thread.lock'
object"), from far inside the executor. `check_picklable(task)` pickles the task the same way and, if
that fails, walks down the task's state to the innermost attribute that fails, and says where it is:

    UnpicklableTaskError: the task cannot be pickled for the job: task.logger.lock (a _thread.lock)
    cannot be pickled (cannot pickle '_thread.lock' object); create it inside __call__ instead of …

The walk is cheap (only the failing branch is descended) and imports nothing heavy.
"""

from __future__ import annotations

import functools
import pickle
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle

from taehv_slurm.common.messages import first_line

MAX_DEPTH = 12  # deep enough for task → config → list → object; a cycle or a huge graph stops here


class UnpicklableTaskError(TypeError):
    """The task cannot be pickled; the message names the attribute path, its type and the fix."""


def check_picklable(task: Any, name: str = "task") -> None:
    """Raise UnpicklableTaskError naming what cannot be pickled in `task` (as submitit pickles it)."""
    reason = _pickle_error(task)
    if reason is None:
        return
    path, culprit, reason = find_unpicklable(task, name) or (name, task, reason)
    raise UnpicklableTaskError(
        f"the {name} cannot be pickled for the job: {path} ({_a(culprit)}) cannot be pickled ({reason}); "
        "create it inside __call__ instead of __init__, or leave it out of the pickled state "
        "(__getstate__), so that it is made on the node"
    )


def find_unpicklable(obj: Any, path: str = "task") -> tuple[str, Any, str] | None:
    """(attribute path, object, pickle error) of the innermost part of `obj` that cannot be pickled,
    or None when `obj` pickles."""
    reason = _pickle_error(obj)
    if reason is None:
        return None
    seen: set[int] = set()
    current, where = obj, path
    for _ in range(MAX_DEPTH):
        seen.add(id(current))
        for child_path, child in _children(current, where):
            if id(child) in seen:
                continue
            child_reason = _pickle_error(child)
            if child_reason is not None:
                current, where, reason = child, child_path, child_reason
                break
        else:  # every part pickles on its own (or there are none): `current` itself is the culprit
            break
    return where, current, reason


def _pickle_error(obj: Any) -> str | None:
    try:
        cloudpickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # TypeError, PicklingError, AttributeError, RecursionError, ...
        return first_line(err)
    return None


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The parts cloudpickle pickles for `obj`, each with a readable path."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
        return
    if isinstance(obj, list | tuple | set | frozenset):
        for i, value in enumerate(obj):
            yield f"{path}[{i}]", value
        return
    if isinstance(obj, functools.partial):
        yield f"{path}.func", obj.func
        yield from _children(list(obj.args), f"{path}.args")
        yield from _children(dict(obj.keywords), f"{path}.keywords")
        return
    if isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
        yield f"{path}.__func__", obj.__func__
        return
    if isinstance(obj, types.FunctionType):
        # A function of a notebook or __main__ travels by value with its closure and the globals it uses.
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f"{path}.<closure {var}>", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for var in obj.__code__.co_names:
            if var in obj.__globals__:
                yield f"{path}.<global {var}>", obj.__globals__[var]
        return
    state = _state(obj)
    if isinstance(state, dict):
        for key, value in state.items():
            yield f"{path}.{key}", value
    elif state is not None:
        yield from _children(state, f"{path}.<state>")


def _state(obj: Any) -> Any:
    getstate = getattr(obj, "__getstate__", None)
    if getstate is not None:
        try:
            state = getstate()
        except Exception:  # a __getstate__ that itself refuses: nothing to descend into
            return None
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            merged = dict(state[0] or {})  # (dict, slots dict) form of objects with __slots__
            merged.update(state[1] or {})
            return merged
        return state
    return getattr(obj, "__dict__", None)


def _a(obj: Any) -> str:
    cls = type(obj)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
