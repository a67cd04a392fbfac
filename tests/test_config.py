"""Config loading: every example config is valid, every bad input is one line naming the fix, and
every cluster field reaches the sbatch script or the job environment."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from taehv_slurm.backends import SlurmBackend
from taehv_slurm.config import (
    ClusterConfig,
    ConfigError,
    OptimConfig,
    TrainConfig,
    load_cluster,
    load_train,
    split_overrides,
)
from taehv_slurm.executor import sbatch_preview
from taehv_slurm.submission import requeueable_task
from taehv_slurm.typed_yaml import parse_set_args

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "cluster").glob("*.yaml")), ids=lambda p: p.name)
def test_example_cluster_configs_load(path: Path) -> None:
    cfg = load_cluster(path)
    assert cfg.tasks_per_node == (cfg.gpus_per_node or cfg.tasks_per_node)


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "train").glob("*.yaml")), ids=lambda p: p.name)
def test_example_train_configs_load(path: Path) -> None:
    assert isinstance(load_train(path), TrainConfig)


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_cluster(tmp_path / "nope.yaml")
    assert "nope.yaml not found" in one_line(err)


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nodes: 2\npartition: [gpu\ntime_min: 5\n")
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    message = one_line(err)
    assert "malformed YAML" in message and "line" in message and str(path) in message


def test_unknown_keys_are_reported_at_once_with_suggestions(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nodse: 2\n")
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert one_line(err) == f"{path}: unknown key 'nodse' (did you mean 'nodes'?)"
    with pytest.raises(ConfigError) as err:
        load_train({"stepz": 3, "optim": {"lrr": 1, "zzz": 2}, "data": {"frame": 8}})
    optim_keys = ", ".join(sorted(f.name for f in dataclasses.fields(OptimConfig)))
    assert one_line(err) == (
        "train config: unknown keys 'stepz' (did you mean 'steps'?), 'optim.lrr' (did you mean 'optim.lr'?), "
        f"'optim.zzz' (keys of optim: {optim_keys}), 'data.frame' (did you mean 'data.frames'?)")


def test_an_override_that_breaks_a_valid_config_is_named_as_given() -> None:
    with pytest.raises(ConfigError) as err:
        load_cluster({"nodes": 2}, origins={"nodes": "--nodes 0"}, nodes=0)
    assert one_line(err).startswith("--nodes 0: nodes must be ≥ 1")
    with pytest.raises(ConfigError) as err:
        load_train({}, **{"optim.lrr": 1})
    assert one_line(err) == "override optim.lrr=1: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"
    # An override that repairs the file is welcome; the file's own error names the file.
    assert load_train({"data": {"source": "video"}}, **{"data.path": "/v"}).data.path == "/v"
    with pytest.raises(ConfigError) as err:
        load_train({"data": {"source": "video"}}, origins={"steps": "--set steps=3"}, steps=3)
    assert one_line(err).startswith("train config: data.source=video needs data.path")


@pytest.mark.parametrize(("data", "needle"), [
    ({"nodes": "two"}, "'nodes' must be an integer, got 'two'"),
    ({"exclusive": "yes"}, "'exclusive' must be true or false"),
    ({"env": ["A=1"]}, "'env' must be a mapping"),
    ({"backend": "kubernetes"}, "'backend' must be one of slurm, local, debug"),
    ({"mem_gb": "lots"}, "'mem_gb' must be a number"),
])
def test_wrong_types(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_cluster(data)
    assert needle in one_line(err)


def test_nonpositive_nodes() -> None:
    for nodes in (0, -3):
        with pytest.raises(ConfigError) as err:
            load_cluster({"nodes": nodes})
        assert "nodes must be ≥ 1" in one_line(err)


def test_tasks_per_node_must_match_gpus_unless_overridden() -> None:
    with pytest.raises(ConfigError) as err:
        load_cluster({"gpus_per_node": 8, "tasks_per_node": 16})
    message = one_line(err)
    assert "tasks_per_node=16 but gpus_per_node=8" in message and "allow_task_gpu_mismatch" in message
    cfg = load_cluster({"gpus_per_node": 8, "tasks_per_node": 1, "allow_task_gpu_mismatch": True})
    assert cfg.tasks_per_node == 1
    assert load_cluster({"gpus_per_node": 4}).tasks_per_node == 4
    assert load_cluster({"gpus_per_node": 0}).tasks_per_node == 1


def test_set_overrides_route_and_parse() -> None:
    overrides = parse_set_args(["nodes=2", "env.NCCL_DEBUG=INFO", "optim.lr=2e-4", "srun_args=[--x]",
                                "data.source=video"])
    cluster_over, train_over = split_overrides(overrides)
    assert cluster_over == {"nodes": 2, "env.NCCL_DEBUG": "INFO", "srun_args": ["--x"]}
    cluster = load_cluster({"env": {"A": "1"}}, **cluster_over)
    assert cluster.nodes == 2 and cluster.env == {"A": "1", "NCCL_DEBUG": "INFO"}
    train = load_train({}, **train_over, **{"data.path": "/videos"})
    assert train.optim.lr == 2e-4 and train.data.source == "video"
    with pytest.raises(ConfigError) as err:
        split_overrides(parse_set_args(["nodez=2"]))
    assert "did you mean 'nodes'" in one_line(err)
    with pytest.raises(ConfigError):
        parse_set_args(["nodes"])


def test_every_cluster_field_reaches_the_script_or_the_job(tmp_path: Path) -> None:
    cfg = load_cluster({
        "name": "tv", "partition": "gpu-h100", "account": "proj42", "qos": "high", "constraint": "h100",
        "nodes": 3, "gpus_per_node": 8, "gres": "gpu:h100:8", "cpus_per_task": 11, "mem_gb": 480,
        "time_min": 77, "exclusive": True, "signal_delay_s": 123, "setup": ["module load cuda/12.4"],
        "env": {"NCCL_SOCKET_IFNAME": "ib0", "HF_TOKEN": "hf_supersecret"}, "srun_args": ["--cpu-bind=none"],
        "sbatch_args": {"mail-type": "END"}, "group": None,
    })
    script = sbatch_preview(cfg, tmp_path / "submitit")
    for flag in ("--job-name=tv", "--partition=gpu-h100", "--account=proj42", "--qos=high",
                 "--constraint=h100",
                 "--nodes=3", "--ntasks-per-node=8", "--gres=gpu:h100:8", "--cpus-per-task=11", "--mem=480GB",
                 "--time=77", "--exclusive", "--signal=USR2@123", "--requeue", "--mail-type=END"):
        assert f"#SBATCH {flag}" in script, flag
    assert "module load cuda/12.4" in script
    assert "export NCCL_SOCKET_IFNAME=ib0" in script
    assert f"export TAEHV_COMPILE_CACHE={cfg.runtime().compile_cache_dir}" in script  # Python's bytecode too
    assert "--cpu-bind=none" in script and "-m taehv_slurm.runtime.entry" in script
    assert "hf_supersecret" not in script and "HF_TOKEN" not in script
    # The fields that shape the job at run time travel with the task.
    runtime = {f.name for f in dataclasses.fields(cfg.runtime())}
    assert {"device", "dist_backend", "rendezvous_timeout_s", "collective_timeout_s", "torch_threads",
            "gpu_memory_gb", "cpus_per_task"} <= runtime
    scheduler = {"name", "partition", "account", "qos", "constraint", "nodes", "gpus_per_node",
                 "tasks_per_node", "gres", "cpus_per_task", "mem_gb", "time_min", "exclusive",
                 "signal_delay_s", "setup", "env", "srun_args", "sbatch_args", "group", "python", "backend",
                 "job_dir", "allow_task_gpu_mismatch", "secret_env", "array_parallelism"}
    requeue = {"kill_wait_s", "max_requeues", "max_requeues_without_progress", "requeue_on_failure",
               "exclude_failed_nodes", "heartbeat_s", "hang_detection", "hang_floor_s", "hang_factor",
               "hang_uncalibrated_s", "restart_in_allocation", "spare_nodes", "min_nodes"}
    task = requeueable_task(lambda ctx: None, tmp_path / "run", load_cluster(
        {"heartbeat_s": 7, "hang_floor_s": 90, "hang_factor": 4, "hang_uncalibrated_s": 900,
         "hang_detection": False, "exclude_failed_nodes": False, "max_requeues": 5}), SlurmBackend())
    four = load_cluster({"nodes": 4, "min_nodes": 2, "gpus_per_node": 8})
    placed = requeueable_task(lambda ctx: None, tmp_path / "run", four, SlurmBackend())
    assert (placed.placement.nodes, placed.placement.min_nodes, placed.placement.tasks_per_node) == (4, 2, 8)
    spared = sbatch_preview(load_cluster({"nodes": 2, "spare_nodes": 1, "job_dir": str(tmp_path)}), tmp_path)
    assert "#SBATCH --nodes=3" in spared and "steps first" in spared and " 2 8 " in spared
    watchdog = task.watchdog
    assert (watchdog.interval_s, watchdog.floor_s, watchdog.factor, watchdog.uncalibrated_s, watchdog.enabled,
            task.exclude_failed_nodes, task.guards.max_requeues) == (7, 90, 4, 900, False, False, 5)
    submit = {"check_data_on_submit", "data_check_budget_s"}  # submit-time checks; see tests/test_local.py
    every = {f.name for f in dataclasses.fields(ClusterConfig)}
    assert every <= scheduler | requeue | runtime | submit, every - scheduler - requeue - runtime - submit


def test_secrets_are_masked() -> None:
    cfg = load_cluster({"env": {"WANDB_API_KEY": "k-123", "MY_VAR": "x", "OTHER": "y"},
                        "secret_env": ["OTHER"]})
    assert cfg.secret_names() == {"WANDB_API_KEY", "OTHER"}
    assert cfg.masked()["env"] == {"WANDB_API_KEY": "***", "MY_VAR": "x", "OTHER": "***"}
    assert cfg.without_secrets().env == {"MY_VAR": "x"}
