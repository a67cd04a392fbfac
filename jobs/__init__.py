"""`python -m jobs.NAME` from a checkout, as the design card promised: each module runs `taehv NAME`.

Not installed with the package (the wheel holds `taehv_slurm` only); installed users run `taehv NAME`.
"""
