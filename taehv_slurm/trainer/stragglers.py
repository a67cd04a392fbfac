"""Slow ranks: the rank the others wait for, named with its cause, once per log window.

A data-parallel step runs at the pace of its slowest rank: every rank waits in the step's collectives (the
step-boundary agreement and the gradient all-reduce) until the last one arrives, so one slow GPU, host,
loader or link costs every rank. Each step `StepClock` splits this rank's time into

- its wait in the step's collectives (on a GPU: device time between CUDA events around them),
- its compute (on a GPU: device time of the rest of the step; on a CPU: the main thread's CPU time),
- its data wait (host seconds blocked on the loader), and
- its stall: host seconds of its own work with the main thread off the CPU (stopped, CPU-starved,
  blocked), which is what a throttled host shows, and
- its host time: the wall seconds of its own work on the host (launching the GPU's work, Python), and
- its backlog (GPUs): how far its device is behind its host when the host reaches the gradient all-reduce,
  the work still queued then. A slow GPU is behind by more than the others' GPUs; a slow host or loader
  leaves its GPU waiting for work, behind by less. (The compute's CUDA events cannot tell these apart: a
  device idle for want of work is timed as compute too.)

The data wait is the loader's part only: a rank's process held off the CPU while it waited (stopped,
throttled, starved) counts as its stall (`HeldOff`), so a slow host whose main thread mostly waits for
its loader is not taken for a slow loader.

Nothing in a step waits for a timing: CUDA events are read at the log line. The log window gathers every
rank's means (one small all-reduce); `SlowRanks.observe` finds the rank that arrives last (it waits
least) and the seconds per step the others waited for it, and names its cause by the figure that sets it
apart from the others: `data`, `host`, `GPU` (`compute` on a CPU, where the device is the CPU) — or
`link` when every rank arrives together but the collectives themselves take long. Report only: it does
not stop or restart anything.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("taehv")
FIGURES = ("step_s", "wait_s", "compute_s", "data_s", "stall_s", "host_s", "backlog_s")  # per rank and step
# slow_rank_margin by device where the cluster config leaves it unset: a GPU's step times are steady to a
# few ms; CPU ranks share the host's cores with each other and the loader, and a window's lateness varied by
# up to 60 % on the 2-core CI testbed with nothing slowed.
DEFAULT_MARGIN = {"cuda": 0.1, "cpu": 0.5}
# The first steps of every start are not judged: compilation, CUDA-graph capture and cuDNN's autotuning make
# them uneven across ranks (2 H200s through Slurm, 2-step windows: rank 0 named "GPU"-slow at steps 3-9 of
# most starts, no longer slow by steps 7-19).
WARMUP_STEPS = 10


class HeldOff:
    """How long this process is held off the CPU (stopped, throttled, CPU-starved) while its main thread
    waits on others, as its loader's workers: a thread that sleeps TICK_S at a time while the wait lasts
    counts each wake more than LATE_S late. The main thread blocked in the wait cannot tell a slow loader
    from its own process not running: all its threads stop together, the loader's workers do not."""

    TICK_S, LATE_S = 0.005, 0.02  # lateness below LATE_S is the scheduler's and the GIL's, not a pause

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._on = threading.Event()
        self._held = 0.0
        self._since: float | None = None  # when the ticking thread last went to sleep
        threading.Thread(target=self._tick, name="taehv-held-off", daemon=True).start()

    def _late(self, now: float) -> float:
        """The lateness of the sleep in progress at `now`, where it counts (under the lock)."""
        late = 0.0 if self._since is None else now - self._since - self.TICK_S
        return late if late > self.LATE_S else 0.0

    def _tick(self) -> None:
        while True:
            self._on.wait()
            with self._lock:
                self._since = time.perf_counter()
            time.sleep(self.TICK_S)
            with self._lock:
                self._held += self._late(time.perf_counter())
                self._since = None

    @contextlib.contextmanager
    def watch(self) -> Iterator[Callable[[], float]]:
        """Around a wait: yields a function that gives the seconds this process was held off during it
        (read it after the wait)."""
        with self._lock:
            start = self._held
        self._on.set()
        held = [0.0]
        try:
            yield lambda: held[0]
        finally:
            self._on.clear()
            with self._lock:  # the sleep in progress may end late with the wait: count it now, not later
                now = time.perf_counter()
                self._held += self._late(now)
                self._since = now if self._since is not None else None
                held[0] = self._held - start


class StepClock:
    """One optimizer step of this rank: its waits in collectives, its compute, data wait, stall and backlog.

    The trainer starts it before the step boundary and marks each section; `figures()` (at the log line)
    gives the step's seconds in FIGURES order, `step_s` left 0 (the window knows the step's length). On a
    GPU the waits and the compute come from CUDA events recorded in the stream (the host never waits for
    them here); the data wait and the stall are host time either way."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # own work: the step less its sections (data, collectives), on the wall clock and the thread's CPU
        self.wall, self.cpu = -time.perf_counter(), -time.thread_time()
        self.data_s = 0.0
        self.wait_s = 0.0  # host seconds in the collectives (the figure on a CPU)
        # on a GPU: each collective's events, whether it ran inside the compute's span, and when the host
        # reached it (perf_counter)
        self.waits: list[tuple[torch.cuda.Event, torch.cuda.Event, bool, float]] = []
        self.began: torch.cuda.Event | None = None
        self.ended: torch.cuda.Event | None = None

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Around a collective every rank runs in the step: its time is waiting, not own work."""
        start = self._event() if self.cuda else None
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            seconds = time.perf_counter() - wall
            self.wait_s += seconds
            self.wall -= seconds
            self.cpu -= time.thread_time() - cpu
            if start is not None:
                self.waits.append((start, self._event(), self.began is not None, wall))

    def data(self, seconds: float, cpu_s: float, held_s: float = 0.0) -> None:
        """A wait for the loader of `seconds` (host), `cpu_s` of them on this thread's CPU and `held_s` of
        them with this process held off the CPU (HeldOff): those are its own time, a stall."""
        self.data_s += seconds - held_s
        self.wall -= seconds - held_s
        self.cpu -= cpu_s

    def compute_begins(self) -> None:
        if self.cuda:
            self.began = self._event()

    def stop(self) -> None:
        """The step's work is done (after the optimizer)."""
        self.wall += time.perf_counter()
        self.cpu += time.thread_time()
        if self.cuda:
            self.ended = self._event()

    def figures(self, anchor: tuple[torch.cuda.Event, float] | None = None) -> tuple[float, ...]:
        """FIGURES' seconds of this step, step_s 0; on a GPU it waits for the step's events. `anchor`: an
        event recorded on an idle device before the step and the perf_counter() then, which places the
        device's events on the host's clock (the backlog; 0 without it)."""
        stall, host = max(0.0, self.wall - self.cpu), max(0.0, self.wall)
        if not self.cuda or self.began is None or self.ended is None:
            return 0.0, self.wait_s, max(0.0, self.cpu), self.data_s, stall, host, 0.0
        self.ended.synchronize()
        waits = [(a.elapsed_time(b) / 1000, inside) for a, b, inside, _ in self.waits]
        compute = self.began.elapsed_time(self.ended) / 1000 - sum(w for w, inside in waits if inside)
        inside = [(start, reached) for start, _, within, reached in self.waits if within]
        backlog = 0.0
        if anchor is not None and inside:  # the last collective in the compute: the gradient all-reduce
            (event, at), (start, reached) = anchor, inside[-1]
            backlog = max(0.0, at + event.elapsed_time(start) / 1000 - reached)
        return 0.0, sum(w for w, _ in waits), max(0.0, compute), self.data_s, stall, host, backlog


def device_anchor(device: torch.device) -> tuple[torch.cuda.Event, float] | None:
    """On a GPU: an event recorded once the device is idle and the host's perf_counter() then, so that
    later events' times can be read on the host's clock (StepClock.figures). Waits for the device."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event, time.perf_counter()


@dataclass(frozen=True)
class Latest:
    """The rank that arrived last in one window (rank None: no rank did; the collectives were slow)."""

    rank: int | None
    cause: str  # data, host, GPU (compute on a CPU) or link
    lost_s: float  # seconds per step the job lost to it: the others' median wait less its own
    late: bool  # past the margin in this window
    detail: str
    excess: dict[str, float] = field(default_factory=dict)  # its figures less the others' medians, per step
    own: dict[str, float] = field(default_factory=dict)  # its figures, per step


def latest_rank(figures: Sequence[Sequence[float]], hosts: Sequence[str], margin: float,
                compute_name: str = "GPU", link_floor: float = 0.0) -> Latest | None:
    """The rank the others waited for in one window, from every rank's FIGURES means per step.

    The rank that waits least arrived last; the job lost the others' median wait less its own per step. It is
    late when that exceeds `margin` × the others' time to arrive (their step less their wait). Its cause is
    the figure by which it exceeds the others' median most where that explains at least half of the wait it
    causes: data wait (`data`), stall (`host`) or compute (`compute_name`: on a GPU its backlog, the device
    work still queued when its host reached the all-reduce; on a CPU its CPU time, with the stall that more
    compute brings on a shared host); otherwise `host` (its time outside compute and data: launches,
    Python, the step's other work). With no rank late, `link` (rank None) when the collectives themselves
    (the last rank's wait) take more than `margin` × the ranks' time to arrive beyond `link_floor` (their
    fastest in this run: a gradient all-reduce is a share of every step, a slow link one that grew). None
    for fewer than 2 ranks."""
    if len(figures) < 2:
        return None
    step = statistics.median(f[0] for f in figures)
    wait, compute, data, stall, host_s, backlog = ([f[i] for f in figures] for i in range(1, 7))
    rank = min(range(len(figures)), key=lambda r: (wait[r], r))
    others = [r for r in range(len(figures)) if r != rank]

    def excess(values: list[float]) -> float:
        return values[rank] - statistics.median(values[r] for r in others)

    lost = max(0.0, -excess(wait))
    arrive = statistics.median(step - wait[r] for r in others)
    threshold = margin * arrive if arrive > 0 else float("inf")
    slower = wait[rank] - link_floor
    if lost <= threshold < slower:
        return Latest(None, "link", slower, True,
                      f"every rank arrives together, but the step's collectives take {wait[rank]:.3f} s per "
                      f"step ({_share(wait[rank], step)}), {slower:.3f} s more than at their fastest in this "
                      "run: a slow link, switch or network between the ranks (`taehv preflight --job` "
                      "measures the bus bandwidth)")
    extra = {"data": excess(data), "stall": excess(stall), "compute": excess(compute), "host": excess(host_s),
             "backlog": excess(backlog)}
    over = {name: extra[name] for name in ("data", "stall", "compute")}  # the candidate causes
    if compute_name == "GPU":
        # The compute's CUDA events also time a device idle for want of work (its host late, or waiting for
        # data), and host figures cannot discount that: a host also blocks on its own busy GPU (measured,
        # docs/failures.md). A slower device is further behind its host: its backlog tells.
        over["compute"] = extra["backlog"]
    else:
        # On a CPU the compute is the host's own CPU time: where the host is shared, each CPU-second of it
        # also costs the wall time it waits for a core (the others' wall per CPU-second, k), so a rank with
        # more compute stalls more too. Its stall counts only beyond k's share.
        k = statistics.median((compute[r] + stall[r]) / compute[r] if compute[r] > 0 else 1.0
                              for r in others)
        over.update(stall=extra["stall"] - (k - 1) * extra["compute"], compute=k * extra["compute"])
    key = max(over, key=lambda name: over[name])
    key = key if over[key] >= lost / 2 and over[key] > 0 else "rest"
    cause = {"data": "data", "compute": compute_name}.get(key, "host")
    host = hosts[rank] if rank < len(hosts) else "?"
    return Latest(rank, cause, lost, lost > threshold,
                  f"rank {rank} on {host}: the others wait {lost:.3f} s per step for it "
                  f"({_share(lost, step)}), cause {cause}: "
                  f"{_why(key, compute_name, compute[rank], data[rank], stall[rank], extra)}",
                  {name: round(value, 4) for name, value in extra.items()},
                  {name.removesuffix("_s"): round(v, 4) for name, v in zip(FIGURES[1:], figures[rank][1:])})


def _why(key: str, compute_name: str, compute: float, data: float, stall: float,
         extra: dict[str, float]) -> str:
    """What sets a late rank apart, in words: its figure and its excess over the others' median."""
    if key == "rest" and compute_name == "GPU":
        return (f"its GPU is not the one behind (its backlog at the gradient all-reduce "
                f"{extra['backlog']:+.3f} s per step against the others'), nor is its data wait "
                f"({data:.3f} s): its host is slow to give its GPU work (stopped, throttled, CPU-starved, or "
                "slow in launches and Python)")
    if key == "compute" and compute_name == "GPU":
        return (f"its GPU is {extra['backlog']:.3f} s per step further behind its host than the others' when "
                f"the gradient all-reduce is reached (its device compute takes {compute:.3f} s per step, "
                f"{extra['compute']:.3f} s more than the others')")
    return {"data": f"it waits {data:.3f} s per step for its data loader, {extra['data']:.3f} s more than "
                    "the others",
            "stall": f"its process was off the CPU {stall:.3f} s per step of its own work (stopped, "
                     f"CPU-starved or blocked), {extra['stall']:.3f} s more than the others",
            "compute": f"its compute takes {compute:.3f} s per step, {extra['compute']:.3f} s more than the "
                       "others'",
            "rest": f"neither its compute ({compute:.3f} s per step), its data wait ({data:.3f} s) nor its "
                    "stall sets it apart: its host is slow outside them (launches, Python, the step's other "
                    "work)"}[key]


def _share(seconds: float, step: float) -> str:
    return f"{100 * seconds / step:.0f} % of a step" if step > 0 else "of a step"


@dataclass
class SlowRanks:
    """Which rank (or the link) is named slow: late in `windows` log windows in a row."""

    hosts: list[str]  # by rank
    margin: float = 0.3
    windows: int = 3
    compute_name: str = "GPU"  # "compute" where the device is the CPU
    streak: dict[int | None, int] = field(default_factory=dict)  # rank (None: link) → late windows in a row
    link_floor: float | None = None  # the collectives' fastest (the last rank's wait) in a judged window
    named: dict[int | None, Latest] = field(default_factory=dict)  # named slow now, as last seen

    def observe(self, figures: Sequence[Sequence[float]], judged: bool = True
                ) -> tuple[dict[str, Any], list[Latest], list[int | None]]:
        """Every rank's FIGURES means of one window (the same list on every rank) → (the log line's fields,
        newly named, no longer slow: a rank, or None for the link). A window not `judged` (the warm-up)
        gives its timings only."""
        step, wait = (statistics.median(f[i] for f in figures) for i in (0, 1))
        fields: dict[str, Any] = {"compute_s": statistics.median(f[2] for f in figures),
                                  "arrive_s": step - wait, "wait_s": wait}
        if not judged:
            return fields, [], []
        collectives = min(f[1] for f in figures)  # the last rank's wait: the collectives themselves
        self.link_floor = collectives if self.link_floor is None else min(self.link_floor, collectives)
        latest = latest_rank(figures, self.hosts, self.margin, self.compute_name, self.link_floor)
        if latest is None:
            return fields, [], []
        # only the rank that arrives last can be late: any other streak ends
        self.streak = {latest.rank: self.streak.get(latest.rank, 0) + 1} if latest.late else {}
        host = None if latest.rank is None else self.hosts[latest.rank]
        fields.update(late_rank=latest.rank, late_host=host, late_cause=latest.cause, late_s=latest.lost_s,
                      late=latest.late, late_excess_s=latest.excess, late_figures_s=latest.own)
        now = {key for key, n in self.streak.items() if n >= self.windows}
        new = [latest for key in now if key not in self.named]
        recovered = [key for key in self.named if key not in now]
        self.named = {key: latest for key in now}
        if self.named:
            fields["slow_ranks"] = [n.detail for n in self.named.values()]
        return fields, new, recovered
