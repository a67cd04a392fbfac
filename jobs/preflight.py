"""`python -m jobs.preflight` from a checkout: the same as `taehv preflight`
(taehv_slurm/cli/preflight.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("preflight")
