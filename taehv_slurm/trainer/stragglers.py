"""Slow ranks: each rank's compute time per step (its own forward and backward, without the waits on the
others and on data), compared across ranks once per log window.

A data-parallel step runs at the pace of its slowest rank, so one slow GPU or node (thermal throttling,
a bad link, a noisy neighbour) costs every rank. The engine times each rank's compute (on a GPU with
CUDA events, read at the log line, so no step waits for them); the log window gathers every rank's mean
(one small all-reduce per log line) and a rank more than `margin` above the median in `windows` log
windows in a row is named: host, rank, how much slower — in metrics.jsonl, the log and events.jsonl.
Report only: it does not stop or restart anything.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

log = logging.getLogger("taehv")


@dataclass
class SlowRanks:
    hosts: list[str]  # by rank
    margin: float = 0.3
    windows: int = 3
    streak: dict[int, int] = field(default_factory=dict)  # rank → slow windows in a row
    named: set[int] = field(default_factory=set)  # ranks named as slow now

    def observe(self, compute_s: list[float]) -> tuple[list[str], list[int], list[int]]:
        """Every rank's mean compute seconds per step in one window (the same list on every rank) →
        (descriptions of the ranks named slow, ranks newly named, ranks no longer slow)."""
        if len(compute_s) < 2:
            return [], [], []
        median = statistics.median(compute_s)
        slow = {rank for rank, s in enumerate(compute_s) if median > 0 and s > median * (1 + self.margin)}
        for rank in range(len(compute_s)):
            self.streak[rank] = self.streak.get(rank, 0) + 1 if rank in slow else 0
        now = {rank for rank, n in self.streak.items() if n >= self.windows}
        new, recovered = sorted(now - self.named), sorted(self.named - now)
        self.named = now
        return [self.describe(rank, compute_s[rank], median) for rank in sorted(now)], new, recovered

    def describe(self, rank: int, seconds: float, median: float) -> str:
        """'rank 3 on tb2: 82 % slower than the median rank (0.412 vs 0.226 s of compute per step)'."""
        return (f"rank {rank} on {self.hosts[rank]}: {100 * (seconds / median - 1):.0f} % slower than the "
                f"median rank ({seconds:.3f} vs {median:.3f} s of compute per step)")
