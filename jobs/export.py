"""`python -m jobs.export` from a checkout: the same as `taehv export` (taehv_slurm/cli/export.py)."""

from taehv_slurm.cli import run_checkout_module

if __name__ == "__main__":
    run_checkout_module("export")
