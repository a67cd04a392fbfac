"""`python -m jobs.NAME` from a checkout: each module runs `taehv NAME`.

Not installed with the package (the wheel holds `taehv_slurm` only); installed users run `taehv NAME`.
"""
