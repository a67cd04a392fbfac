"""Read what W&B's offline mode wrote (`<dir>/wandb/offline-run-*/run-<id>.wandb`): the run id and the
history steps of each file, as `wandb sync` would upload them. wandb 0.2x+ no longer ships a reader; the
file is a LevelDB-style log (wandb's "datastore": a 7-byte header ':W&B' 0xBEE1 0, then 32 KiB blocks of
records <crc32c u32, length u16, type u8> + data; a record that does not fit is split FIRST/MIDDLE/LAST)
of protobuf `Record`s (wandb.proto.wandb_internal_pb2)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path}: not a W&B log"
    out, pending, index = [], b"", HEADER
    while index + HEADER <= len(data):
        left = BLOCK - index % BLOCK
        if left < HEADER:  # the rest of the block is padding
            index += left
            continue
        _, length, kind = struct.unpack("<IHB", data[index:index + HEADER])
        if length == 0 and kind == 0:  # zero padding at the end of a block
            index += left
            continue
        chunk = data[index + HEADER:index + HEADER + length]
        index += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


class OfflineRun(NamedTuple):
    run_id: str | None
    steps: list[int]  # of its history rows, in order
    keys: set[str]  # every key logged in those rows (an image: its own key)


def offline_runs(folder: Path) -> list[OfflineRun]:
    """Every offline run W&B wrote under `folder`/wandb, oldest first."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for path in sorted(Path(folder, "wandb").glob("offline-run-*/run-*.wandb")):
        run = OfflineRun(None, [], set())
        for raw in records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = run._replace(run_id=record.run.run_id)
            elif kind == "history":
                run.steps.append(record.history.step.num)
                # an image is logged as nested keys under its own: ("val/sample", "_type"), ...
                run.keys.update(item.key or item.nested_key[0] for item in record.history.item)
        found.append(run)
    return found
