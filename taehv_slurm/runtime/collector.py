"""Python's cyclic garbage collector across a rank's start.

A rank's start imports torch (then Dynamo, DeepSpeed, the trainer) and builds its model: millions of objects
that live as long as the process. While they are made, the collector walks them again and again and frees
nothing; later, each full collection walks them all again, and so does the interpreter's exit. So a rank
starts with the collector off (`pause`: the entry points) and, once its state is loaded
(`RunContext.started`), freezes what the start made (`resume`: `gc.freeze` moves every object into a
generation no collection looks at) and turns the collector on again; what is made later is collected as
usual; the loader's workers, forked after, inherit the frozen objects and never touch their pages in a
collection. A rank of the quick test config to its first step's end: 4.2–4.5 → 2.9–3.1 CPU-s
(docs/benchmarks.md).

What the start made is never collected, so whatever it owns that holds a process, a thread or a file is
closed explicitly (as `Trainer.close` stops the loader's workers), never left to the collector.
"""

from __future__ import annotations

import gc

_paused = False  # by `pause`: only a start this module paused is resumed, never a user's own process


def pause() -> None:
    """The collector off, for a start's imports and setup (until `resume`)."""
    global _paused
    _paused = True
    gc.disable()


def resume() -> None:
    """After `pause`: everything made so far frozen out of later collections, and the collector on.
    Elsewhere (a task called in a notebook, say) nothing: the collector stays as its user left it."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
