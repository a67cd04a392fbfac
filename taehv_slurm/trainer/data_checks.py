"""The trainer's data readers on a sample of the dataset, before a job waits in the queue: the same code
the job will run, so a folder that passes here is one the job can read.

    python -m taehv_slurm.trainer.data_checks    # {"train": {...}, "sample": 8, "budget_s": 10} on stdin

`taehv submit` and `taehv preflight` run it in a process of its own (taehv_slurm.submit_checks), so the
submitting process never imports torch; it prints {"result": PASS|WARN|FAIL|SKIP, "detail": ...} as its
last line.
Within its budget: a large folder is listed only as far as the budget allows (the sample is then drawn
from what was listed; the job lists it all), and decoding stops when the budget is spent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from taehv_slurm.common.config import VIDEO_EXTENSIONS, TrainConfig, load_train
from taehv_slurm.common.messages import one_line
from taehv_slurm.trainer.data import ClipSpec, VideoFolderClips
from taehv_slurm.trainer.prepared import PreparedClips
from taehv_slurm.trainer.shapes import SPATIAL_FACTOR, TIME_FACTOR
from taehv_slurm.trainer.shards import read_shard_header, shard_path

LISTING_SHARE = 0.4  # of the budget, for listing a video folder; the rest decodes the sample


def check_dataset(train: TrainConfig, sample: int, budget_s: float = 60.0) -> tuple[str, str]:
    """(PASS | WARN | FAIL | SKIP, detail) for the configured data; the readers' own one-line errors raise."""
    d = train.data
    if d.source == "synthetic":
        return "SKIP", "data.source synthetic: clips are generated, nothing to read"
    if d.source == "video":
        return _check_videos(Path(d.path or ""), train, sample, time.monotonic() + budget_s, budget_s)
    return _check_prepared(Path(d.path or ""), train, sample)


def list_videos(root: Path, deadline: float) -> tuple[list[Path], bool]:
    """The video files under `root` as far as listing gets before `deadline`: (files, complete)."""
    found: list[Path] = []
    pending = [root]
    while pending:
        if time.monotonic() > deadline:
            return sorted(found), False
        folder = pending.pop()
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=True):
                    pending.append(Path(entry.path))
                elif Path(entry.name).suffix.lower() in VIDEO_EXTENSIONS and entry.is_file():
                    found.append(Path(entry.path))
    return sorted(found), True


def _check_videos(root: Path, train: TrainConfig, sample: int, deadline: float,
                  budget_s: float) -> tuple[str, str]:
    """Open a sample of the video files with the trainer's own reader and decode one window of each."""
    spec = ClipSpec(train.data.frames, train.data.height, train.data.width)
    files, complete = (list_videos(root, time.monotonic() + LISTING_SHARE * budget_s) if root.is_dir()
                       else ([], True))
    if not files:
        VideoFolderClips(root, spec)  # raises the reader's one-line error for a missing or empty folder
    step = max(1, len(files) // max(1, sample))
    picked = files[::step][:sample]
    names = {f"{i:04d}": str(p.relative_to(root)) for i, p in enumerate(picked)}
    with (tempfile.TemporaryDirectory(prefix="taehv-check-") as tmp,
          _captured_warnings("taehv_slurm.trainer.data") as warnings):
        for i, path in enumerate(picked):  # links named by position: the reader indexes this sample only
            os.symlink(path.absolute(), Path(tmp) / f"{i:04d}{path.suffix.lower()}")
        start = time.perf_counter()
        try:
            clips = VideoFolderClips(tmp, spec)
        except ValueError:
            clips = None
        decoded = tried = 0
        if clips is not None:
            firsts: dict[str, int] = {}
            for index, (path, _) in enumerate(clips.windows):
                firsts.setdefault(path, index)
            for i in firsts.values():
                if tried and time.monotonic() > deadline:
                    break
                tried += 1
                decoded += clips[i]["index"] == i  # another index: it substituted a failed window
        seconds = time.perf_counter() - start
    why = "; ".join(_unlink_names(w, names) for w in warnings[:3]) + ("; ..." if len(warnings) > 3 else "")
    if not decoded:
        return "FAIL", (f"none of {len(picked)} sampled file(s) under {root} decodes a "
                        f"{spec.frames}-frame window: "
                        f"{why or 'no reason logged'}")
    unprobed = len(picked) - len(clips.videos) if clips is not None else 0
    bad = unprobed + tried - decoded
    listed = (f"{len(files)} video file(s) under {root}" if complete else
              f"{len(files)}+ video files under {root} (listing stopped at the check's budget; the job lists "
              "them all)")
    detail = (f"{listed}; {decoded} of {tried + unprobed} sampled decode a "
              f"{spec.frames}×{spec.height}×{spec.width} window ({seconds / max(1, tried):.2f} s per file)")
    if bad:
        return "WARN", f"{detail}; {bad} skipped and counted: {why}"
    return "PASS", detail


def _check_prepared(root: Path, train: TrainConfig, sample: int) -> tuple[str, str]:
    """Open the prepared shards with the trainer's own reader and read a sample of clips."""
    clips = PreparedClips(root,
                          ClipSpec(train.data.frames, train.data.height, train.data.width))  # one-line errors
    if problem := _latents_mismatch(root, clips, train):
        return "FAIL", problem
    n = len(clips)
    picked = range(0, n, max(1, n // max(1, sample)))[:sample]
    start = time.perf_counter()
    for i in picked:
        clips[i]
    seconds = time.perf_counter() - start
    return "PASS", (f"{n} prepared clip(s) under {root}; read {len(picked)} of them "
                    f"({seconds / max(1, len(picked)):.3f} s per clip)")


def _latents_mismatch(root: Path, clips: PreparedClips, train: TrainConfig) -> str | None:
    """The stored teacher latents' shape (from a shard's header) against what this model trains on."""
    d = train.data
    _, tensors = read_shard_header(shard_path(root, int(clips.shards[0])))
    stored = list(tensors["latents"]["shape"][1:])  # latent frames × channels × height × width
    wanted = [d.frames // TIME_FACTOR, train.model.latent_channels, d.height // SPATIAL_FACTOR,
              d.width // SPATIAL_FACTOR]
    if stored[1] != wanted[1]:
        return (f"{root} holds teacher latents of {stored[1]} channels, the model has "
                f"model.latent_channels {wanted[1]}: set model.latent_channels {stored[1]}, or prepare "
                "again with a teacher of that many channels into a new --out")
    if stored != wanted:
        return (f"{root} holds latents of shape {'×'.join(map(str, stored))}, the clips need "
                f"{'×'.join(map(str, wanted))}: prepare again for data.frames/height/width into a new --out")
    return None


@contextlib.contextmanager
def _captured_warnings(logger_name: str) -> Iterator[list[str]]:
    """The data reader's 'skipping ...' warnings, collected for the table instead of printed."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, propagate = Collect(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _unlink_names(message: str, names: dict[str, str]) -> str:
    # "skipping /tmp/x/0003.mp4: unreadable (...)" → "skipping broken.mp4: unreadable (...)"
    return re.sub(r"[^\s'\"]*/(\d{4})(\.\w+)", lambda m: names.get(m.group(1), m.group(0)), message)


def main() -> None:
    request = json.load(sys.stdin)
    try:
        result, detail = check_dataset(load_train(request["train"]), int(request.get("sample", 8)),
                                       float(request.get("budget_s", 60.0)))
    except Exception as err:  # the readers' own one-line errors (missing, empty, another clip spec)
        result, detail = "FAIL", one_line(err)
    print(json.dumps({"result": result, "detail": detail}), flush=True)


if __name__ == "__main__":
    main()
