"""`python -m jobs.status` from a checkout: the same as `taehv status` (taehv_slurm/cli/status.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("status")
