"""The `taehv` command: one subcommand per module of this package (argument parsing and printing only).

    taehv submit|status|logs|cancel|export|prepare|preflight|launch ...
    python -m taehv_slurm submit ...          # the same, without the console script
    python -m jobs.submit ...                 # the same, from a checkout (the jobs/ shims)

Every message that names one of our commands names it the way the user ran this one: the style is
kept in the environment (TAEHV_CLI), so jobs submitted from here say it the same way.
"""

from __future__ import annotations

import importlib
import os
import sys

from taehv_slurm.common.messages import CLI_ENV

COMMANDS = {
    "submit": "submit training (or the smoke check) to Slurm, or run it here with --local",
    "status": "status of submitted runs, or Slurm's accounting of them",
    "logs": "show or follow one rank's log",
    "cancel": "cancel runs (they save first)",
    "export": "export a trained model in the published TAEHV layout",
    "prepare": "precompute teacher latents into shards",
    "preflight": "check configs, data, Slurm and the nodes before a long run",
    "launch": "start training on a container platform or under torchrun (one process per node)",
}


def usage(style: str) -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {style} COMMAND [ARGS]   ({style} COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None, style: str = "taehv") -> int:
    """Run subcommand argv[0] with the rest; `style` is how the user invoked us (`taehv`,
    `python -m taehv_slurm`, or `jobs` for the checkout's `python -m jobs.NAME`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(style))
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"error: {style}: no command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    os.environ[CLI_ENV] = style
    return importlib.import_module(f"taehv_slurm.cli.{name}").main(rest) or 0


def console() -> None:
    """The `taehv` console script."""
    sys.exit(main())


def run_checkout_module(name: str) -> None:
    """`python -m jobs.NAME` from a checkout: the same as `taehv NAME`."""
    sys.exit(main([name, *sys.argv[1:]], style="jobs"))
