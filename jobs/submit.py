"""`python -m jobs.submit` from a checkout: the same as `taehv submit` (taehv_slurm/cli/submit.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("submit")
