"""The loader's shared memory (/dev/shm), where batches cross from its worker processes to the rank.

Every batch a worker has loaded and its rank has not taken yet lives there: `num_workers ×
prefetch_factor` batches for each rank of the node. A container's /dev/shm is often small (Docker's default
is 64 MB; one micro-batch of the shipped config holds 50 MB of frames), and other jobs may fill a node's.
`fit_loader` lowers those numbers to what is free at the stream's start (the prefetch first, then the
workers; at worst none, and the rank reads its data itself) and says so. Each batch is stacked straight
into shared memory in the worker (torch's `default_collate`; `in_shared_memory` its small fields), so
that a /dev/shm that fills up later fails there, as an error the loader passes on (`out_of_shared_memory`
gives it its one line). Left to the queue's feeder thread, which pickles the batch, that error is printed
there and the batch dropped, and the rank waits for it forever.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a loader runs, not by the modules that only name these
    import torch
    from torch.utils.data import DataLoader

    from taehv_slurm.runtime.distenv import DistEnv

SHM = "/dev/shm"
SHM_SHARE = 0.5  # of the free shared memory, what the loaders of a node's ranks may hold
BATCH_MARGIN = 1.25  # a micro-batch's bytes over its frames' (the teacher's latents, the indices)
MB = 1e6


def free_bytes(path: str = SHM) -> int | None:
    """Bytes free in the shared-memory filesystem; None where there is none to ask."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def fit_loader(workers: int, prefetch: int, batch_bytes: float, ranks_on_node: int,
               free: int | None) -> tuple[int, int, str | None]:
    """(workers, prefetch, a line saying what was lowered and why, or None): the loader's batches in flight
    within this rank's share of the node's free shared memory."""
    if workers == 0 or free is None:
        return workers, prefetch, None
    fits = int(SHM_SHARE * free / max(1, ranks_on_node) // batch_bytes)  # batches this rank may hold
    if workers * prefetch <= fits:
        return workers, prefetch, None
    fitted = (workers, fits // workers) if fits >= workers else (fits, 1) if fits else (0, prefetch)
    now = (f"{fitted[0]} worker{'s' if fitted[0] > 1 else ''}, prefetch {fitted[1]}" if fitted[0]
           else "no workers (this rank reads its data itself)")
    return *fitted, (
        f"loader: {SHM} has {free / MB:.0f} MB free for {ranks_on_node} rank(s) on this node, and "
        f"{workers} workers × prefetch {prefetch} would hold {workers * prefetch} batches of "
        f"≈{batch_bytes / MB:.1f} MB each: {now} instead; give the job more shared memory for the full "
        f"loader (a container's --shm-size, or --ipc=host)")


def fitted_loader(workers: int, prefetch: int, batch_bytes: float, env: DistEnv,
                  log: logging.Logger) -> tuple[int, int]:
    """A loader's (workers, prefetch) fitted to this node's free shared memory (`fit_loader`); the node's
    first rank says what it lowered."""
    workers, prefetch, note = fit_loader(workers, prefetch, batch_bytes, env.local_world_size, free_bytes())
    if note and env.local_rank == 0:
        log.warning(note)
    return workers, prefetch


def frames_bytes(frames: int, height: int, width: int) -> int:
    """A clip's or window's frames as the loaders carry them: uint8 RGB."""
    return frames * 3 * height * width


def in_shared_memory(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`; in a loader worker, moved into shared memory (see the module's docstring)."""
    import torch

    return tensor if torch.utils.data.get_worker_info() is None else tensor.share_memory_()


def batches(loader: DataLoader) -> Iterator[Any]:
    """The loader's batches, its worker's full /dev/shm as one line (`out_of_shared_memory`); the workers
    stopped when it ends, however it ends (not when an error's traceback, which holds the iterator, is freed:
    they would hold the rank's exit)."""
    iterator = iter(loader)
    try:
        yield from iterator
    except RuntimeError as err:
        if (line := out_of_shared_memory(err, loader.num_workers, loader.prefetch_factor or 0)) is None:
            raise
        raise RuntimeError(line) from err
    finally:
        if (shutdown := getattr(iterator, "_shutdown_workers", None)) is not None:
            shutdown()


def out_of_shared_memory(err: BaseException, workers: int, prefetch: int) -> str | None:
    """One line for a loader worker that found /dev/shm full, else None."""
    if "unable to allocate shared memory" not in str(err):
        return None
    free = free_bytes()
    size = (f"{free / MB:.0f} MB free now" if free is not None else "its size unknown")
    return (f"a loader worker found no room for a batch in {SHM} ({size}; {workers} workers × prefetch "
            f"{prefetch} per rank): give the job more shared memory (a container's --shm-size, or "
            "--ipc=host) or free it; a restart fits the loader to what is free")
