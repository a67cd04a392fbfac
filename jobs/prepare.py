"""`python -m jobs.prepare` from a checkout: the same as `taehv prepare` (taehv_slurm/cli/prepare.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("prepare")
