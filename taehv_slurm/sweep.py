"""Sweeps: a grid of training-config values → one train config per point, and run folder names.

`--sweep optim.lr=1e-4,2e-4 --sweep seed=0,1` (or {"optim.lr": [1e-4, 2e-4], "seed": [0, 1]} from Python)
is every combination in order; a sweep is submitted as one job array (taehv_slurm.training.submit_sweep).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from taehv_slurm.common.config import ConfigError, TrainConfig, load_train, split_overrides
from taehv_slurm.common.typed_yaml import load_yaml


def sweep_grid(items: list[str] | Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """`["optim.lr=1e-4,2e-4", "seed=0,1"]` (or {"optim.lr": [1e-4, 2e-4], ...}) → every combination,
    in order.

    Only training keys can be swept: a job array shares one cluster shape.
    """
    pairs = ([(k, list(v)) for k, v in items.items()] if isinstance(items, Mapping)
             else [_parse_sweep_item(item) for item in items])
    axes = []
    for key, values in pairs:
        cluster_keys, _ = split_overrides({key: None})  # raises on unknown keys, with a suggestion
        if cluster_keys:
            raise ConfigError(f"--sweep {key}: only training keys can be swept "
                              "(a job array shares one cluster "
                              f"shape); submit one job per {key} instead")
        if not values:
            raise ConfigError(f"--sweep {key}: no values; expected e.g. --sweep {key}=V1,V2")
        if len(set(map(str, values))) != len(values):
            raise ConfigError(f"--sweep {key}: repeated values in {values}")
        axes.append([(key, v) for v in values])
    if len({key for key, _ in pairs}) != len(pairs):
        raise ConfigError("--sweep: the same key is swept twice; put all its values in one --sweep KEY=V1,V2")
    return [dict(combo) for combo in itertools.product(*axes)]


def _parse_sweep_item(item: str) -> tuple[str, list[Any]]:
    key, sep, values = item.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2,... e.g. --sweep optim.lr=1e-4,2e-4")
    return key.strip(), [load_yaml(v) for v in values.split(",") if v.strip()]


def sweep_trains(train: TrainConfig,
                 grid: list[dict[str, Any]]) -> tuple[list[TrainConfig], list[dict[str, Any]]]:
    """One train config per sweep point, and the points with each value as the config holds it
    (YAML reads `1e-4` as text; the config coerces it to 0.0001, which is what the runs record)."""
    trains = [load_train(train.to_dict(), **point) for point in grid]
    points = [{key: _lookup(t.to_dict(), key) for key in point} for t, point in zip(trains, grid)]
    return trains, points


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def point_name(point: Mapping[str, Any]) -> str:
    """A run folder name for a sweep point: `lr=0.0001,seed=1` (the last part of each key)."""
    short = [key.rsplit(".", 1)[-1] for key in point]
    keys = short if len(set(short)) == len(short) else list(point)
    text = ",".join(f"{k}={v}" for k, v in zip(keys, point.values()))
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
