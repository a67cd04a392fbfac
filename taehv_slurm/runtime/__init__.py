"""What runs on every rank of a job: the entry point, who-am-I (`DistEnv`), the run context and the
requeue flow, checkpoints, the run lock, the local controller and the node launcher. Imports the standard
library, torch (inside the functions that need it) and the small pure modules of taehv_slurm (config,
plan, messages, security); never the submitting side's modules — a backend object is handed in."""
