"""`python -m taehv_slurm COMMAND ...`: the `taehv` command without the console script."""

import sys

from taehv_slurm.cli import main

sys.exit(main(style="python -m taehv_slurm"))
