"""`PreparedClips`: training clips and their teacher latents, read from the shards `taehv prepare` wrote.

Item i is row i of the folder's index.csv (sorted by window: videos by path, windows by start), so the
order is deterministic and the same for every rank and worker. Shards are opened lazily with
safetensors' memory-mapped `safe_open`, separately in each DataLoader worker process (a handle never
crosses a fork), at most `max_open` at a time; an item reads just its own rows.
"""

from __future__ import annotations

import csv
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from taehv_slurm.common.messages import command
from taehv_slurm.trainer.data import ClipSpec
from taehv_slurm.trainer.manifest import INDEX_FILE, PrepareError, read_manifest_info
from taehv_slurm.trainer.shards import shard_path


class PreparedClips(Dataset):
    """Map-style dataset over a prepared folder: {"frames": uint8 T×3×H×W, "latents": bf16 L×C×h×w,
    "index": i}.

    Raises a one-line ValueError when the folder is missing, not prepared, not verified (no index.csv)
    or prepared for another clip spec than `spec`.
    """

    def __init__(self, root: str | os.PathLike, spec: ClipSpec, max_open: int = 64) -> None:
        self.root, self.spec, self.max_open = Path(root), spec, max_open
        try:
            info = read_manifest_info(self.root)
        except PrepareError as err:
            raise ValueError(str(err)) from None
        prepared = (int(info["frames"]), int(info["height"]), int(info["width"]))
        wanted = (spec.frames, spec.height, spec.width)
        if prepared != wanted:
            raise ValueError(
                f"{self.root} holds {'×'.join(map(str, prepared))} clips (frames×height×width) "
                f"but the config asks for {'×'.join(map(str, wanted))}; "
                f"set data.frames/height/width to {prepared[0]}/{prepared[1]}/{prepared[2]} "
                f"or prepare again with --frames {wanted[0]} --height {wanted[1]} --width {wanted[2]} "
                "into a new --out")
        index = self.root / INDEX_FILE
        if not index.is_file():
            raise ValueError(f"{self.root} has no {INDEX_FILE}: its preparation is unfinished or "
                             "unverified; run "
                             f"`{command('prepare')} --verify --out {self.root}` (it lists what is missing)")
        with open(index, newline="") as f:
            rows = [(int(r["shard"]), int(r["offset"])) for r in csv.DictReader(f)]
        if not rows:
            raise ValueError(f"{index} lists no clips: every window failed to decode; "
                             "check the videos and prepare again")
        table = np.asarray(rows, dtype=np.int64)
        self.shards, self.offsets = table[:, 0], table[:, 1]
        self.info = info
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.shards):
            raise IndexError(f"clip {index} out of range [0, {len(self.shards)})")
        handle = self._open(int(self.shards[index]))
        row = int(self.offsets[index])
        frames = handle.get_slice("frames")[row: row + 1][0]
        latents = handle.get_slice("latents")[row: row + 1][0]
        return {"frames": frames, "latents": latents, "index": index}

    def _open(self, shard: int) -> Any:
        from safetensors import safe_open

        if os.getpid() != self._pid:  # a forked DataLoader worker: open its own handles
            self._handles, self._pid = OrderedDict(), os.getpid()
        handle = self._handles.get(shard)
        if handle is not None:
            self._handles.move_to_end(shard)
            return handle
        path = shard_path(self.root, shard)
        try:
            handle = safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} is listed in {self.root / INDEX_FILE} but missing; run "
                                    f"`{command('prepare')} --verify --out {self.root}` "
                                    "and prepare the rest") from None
        self._handles[shard] = handle
        if len(self._handles) > self.max_open:  # bound open files/maps per process (thousands of shards)
            self._handles.popitem(last=False)
        return handle

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"] = OrderedDict()  # handles are per process (spawned workers reopen them)
        return state

