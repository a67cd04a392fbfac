"""The trainer's data readers on a sample of the dataset, for `taehv preflight`: the same code the
job will run, so a folder that passes here is one the job can read."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from taehv_slurm.config import VIDEO_EXTENSIONS, TrainConfig
from taehv_slurm.trainer.data import ClipSpec, VideoFolderClips
from taehv_slurm.trainer.prepared import PreparedClips


def check_dataset(train: TrainConfig, sample: int) -> tuple[str, str]:
    """(PASS | WARN | FAIL | SKIP, detail) for the configured data; the readers' own one-line errors raise."""
    d = train.data
    if d.source == "synthetic":
        return "SKIP", "data.source synthetic: clips are generated, nothing to read"
    if d.source == "video":
        return _check_videos(Path(d.path or ""), train, sample)
    return _check_prepared(Path(d.path or ""), train, sample)


def _check_videos(root: Path, train: TrainConfig, sample: int) -> tuple[str, str]:
    """Open a sample of the video files with the trainer's own reader and decode one window of each."""
    spec = ClipSpec(train.data.frames, train.data.height, train.data.width)
    files = (sorted(p for p in root.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file())
             if root.is_dir() else [])
    if not files:
        VideoFolderClips(root, spec)  # raises the reader's one-line error for a missing or empty folder
    step = max(1, len(files) // max(1, sample))
    picked = files[::step][:sample]
    names = {f"{i:04d}": str(p.relative_to(root)) for i, p in enumerate(picked)}
    with (tempfile.TemporaryDirectory(prefix="taehv-preflight-") as tmp,
          _captured_warnings("taehv_slurm.trainer.data") as warnings):
        for i, path in enumerate(picked):  # links named by position: the reader indexes this sample only
            os.symlink(path.absolute(), Path(tmp) / f"{i:04d}{path.suffix.lower()}")
        start = time.perf_counter()
        try:
            clips = VideoFolderClips(tmp, spec)
        except ValueError:
            clips = None
        decoded = 0
        if clips is not None:
            firsts: dict[str, int] = {}
            for index, (path, _) in enumerate(clips.windows):
                firsts.setdefault(path, index)
            decoded = sum(clips[i]["index"] == i for i in firsts.values())  # another index: it substituted
        seconds = time.perf_counter() - start
    why = "; ".join(_unlink_names(w, names) for w in warnings[:3]) + ("; ..." if len(warnings) > 3 else "")
    if not decoded:
        return "FAIL", (f"none of {len(picked)} sampled file(s) under {root} decodes a "
                        f"{spec.frames}-frame window: "
                        f"{why or 'no reason logged'}")
    bad = len(picked) - decoded
    detail = (f"{len(files)} video file(s) under {root}; {decoded} of {len(picked)} sampled decode a "
              f"{spec.frames}×{spec.height}×{spec.width} window ({seconds / len(picked):.2f} s per file)")
    if bad:
        return "WARN", f"{detail}; {bad} skipped and counted: {why}"
    return "PASS", detail


def _check_prepared(root: Path, train: TrainConfig, sample: int) -> tuple[str, str]:
    """Open the prepared shards with the trainer's own reader and read a sample of clips."""
    clips = PreparedClips(root,
                          ClipSpec(train.data.frames, train.data.height, train.data.width))  # one-line errors
    n = len(clips)
    picked = range(0, n, max(1, n // max(1, sample)))[:sample]
    start = time.perf_counter()
    for i in picked:
        clips[i]
    seconds = time.perf_counter() - start
    return "PASS", (f"{n} prepared clip(s) under {root}; read {len(picked)} of them "
                    f"({seconds / max(1, len(picked)):.3f} s per clip)")


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
