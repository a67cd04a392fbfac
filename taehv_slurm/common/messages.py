"""How the library and its jobs say things: an error in one line, a rank's log lines, and our commands
named the way the user runs them."""

from __future__ import annotations

import logging
import os
import sys


def first_line(err: BaseException | str) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(err).strip()
    if text:
        return text.splitlines()[0]
    return type(err).__name__ if isinstance(err, BaseException) else ""


def one_line(err: BaseException) -> str:
    """'ValueError: first line of the message' — how a failure is recorded and shown."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def rank_logger(name: str, rank: int, every_rank_informs: bool = False) -> logging.Logger:
    """The logger a rank writes its progress to: timestamped lines on stdout (the rank's log file under a
    scheduler), tagged with the rank. Only rank 0 informs (one voice per job) unless every rank's work
    is its own (prepare's shards); the others warn."""
    log = logging.getLogger(name)
    log.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 or every_rank_informs else logging.WARNING)
    log.propagate = False
    return log


CLI_ENV = "TAEHV_CLI"  # how the user runs our commands; set by the CLI, inherited by the jobs it submits


def command(sub: str) -> str:
    """How the user runs subcommand `sub`, the way they invoked the CLI: `taehv submit` (the default),
    `python -m taehv_slurm submit`, or `python -m jobs.submit` from a checkout."""
    style = os.environ.get(CLI_ENV) or "taehv"
    return f"python -m jobs.{sub}" if style == "jobs" else f"{style} {sub}"
