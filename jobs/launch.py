"""`python -m jobs.launch` from a checkout: the same as `taehv launch` (taehv_slurm/cli/launch.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("launch")
