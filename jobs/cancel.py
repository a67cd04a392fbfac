"""`python -m jobs.cancel` from a checkout: the same as `taehv cancel` (taehv_slurm/cli/cancel.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("cancel")
