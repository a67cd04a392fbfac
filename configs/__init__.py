"""Example configs (cluster/, train/, platform/), installed as `taehv_slurm.configs`: `configs/...` paths
given to the CLIs and to `load_cluster`/`load_train` work from any folder
(taehv_slurm.common.config.shipped_config)."""
