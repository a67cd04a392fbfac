"""`python -m jobs.logs` from a checkout: the same as `taehv logs` (taehv_slurm/cli/logs.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("logs")
