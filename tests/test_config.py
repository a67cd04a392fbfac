"""Config loading: every example config is valid, every bad input is one line naming the fix, and
every cluster field reaches the sbatch script or the job environment."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import submitit
import yaml

from bench.videos import write_video
from taehv_slurm import snapshot
from taehv_slurm.backends import SlurmBackend
from taehv_slurm.common.changes import flatten
from taehv_slurm.common.config import (
    ClusterConfig,
    ConfigError,
    OptimConfig,
    load_cluster,
    load_train,
    split_overrides,
)
from taehv_slurm.common.plan import plan_for
from taehv_slurm.common.typed_yaml import parse_set_args
from taehv_slurm.executor import LocalExecutor, SlurmExecutor, make_executor, sbatch_preview
from taehv_slurm.submission import requeueable_task, secrets_in_environ
from taehv_slurm.submit_checks import submit_checks

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "cluster").glob("*.yaml")), ids=lambda p: p.name)
def test_example_cluster_configs_load(path: Path) -> None:
    """Every value the file sets is the loaded config's (none dropped, none replaced by a default), and a
    file that does not set tasks_per_node gets one task per GPU (one per node without GPUs)."""
    written = yaml.safe_load(path.read_text())
    cfg = load_cluster(path)
    assert {key: getattr(cfg, key) for key in written} == written
    if "tasks_per_node" not in written:
        assert cfg.tasks_per_node == (cfg.gpus_per_node or 1) == (written.get("gpus_per_node", 8) or 1)


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "train").glob("*.yaml")), ids=lambda p: p.name)
def test_example_train_configs_load(path: Path) -> None:
    """Every value the file sets, at any depth, is the loaded config's."""
    written = flatten(yaml.safe_load(path.read_text()))
    loaded = flatten(load_train(path).to_dict())
    assert {key: loaded.get(key, "missing") for key in written} == written


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



def test_a_value_with_colons_stays_text_in_a_file_and_in_set(tmp_path: Path) -> None:
    """YAML 1.1 reads `1:30` as 90 (base 60): an env value `RANK:SECONDS` reached the ranks as a number."""
    config = tmp_path / "cluster.yaml"
    config.write_text(f"job_dir: {tmp_path}\nenv:\n  WINDOW: 1:30\n  SPAN: 12:30:00\n")
    cluster = load_cluster(config, **split_overrides(parse_set_args(["env.EXTRA=1:0.25"]))[0])
    assert cluster.env == {"WINDOW": "1:30", "SPAN": "12:30:00", "EXTRA": "1:0.25"}
    assert parse_set_args(["nodes=2", "optim.lr=2e-4", "x=0x10", "y=-1.5"]) == {
        "nodes": 2, "optim.lr": "2e-4", "x": 16, "y": -1.5}  # numbers without colons are numbers still

# A cluster config with every field away from its default, and where each field must show: in the sbatch
# script, the task every rank runs (its requeue limits, signal budgets, watchdog), the settings the trainer
# gets, the executor, or the submit-time checks. The table names every field (checked below).
PROBE = {
    "name": "tv", "backend": "slurm", "partition": "gpu-h100", "account": "proj42", "qos": "high",
    "constraint": "h100", "nodes": 3, "gpus_per_node": 6, "tasks_per_node": 3,
    "allow_task_gpu_mismatch": True, "gres": "gpu:h100:6", "cpus_per_task": 11, "mem_gb": 480, "time_min": 77,
    "exclusive": True,
    "signal_delay_s": 123, "kill_wait_s": 47, "max_requeues": 5, "max_requeues_without_progress": 4,
    "requeue_on_failure": False, "exclude_failed_nodes": False, "hang_detection": False, "heartbeat_s": 7,
    "hang_floor_s": 90, "hang_factor": 4, "hang_uncalibrated_s": 900, "slow_rank_margin": 0.7,
    "slow_rank_windows": 9, "setup": ["module load cuda/12.4"],
    "env": {"NCCL_SOCKET_IFNAME": "ib0", "HF_TOKEN": "hf_supersecret", "TAEHV_OPAQUE": "opaque-value"},
    "secret_env": ["TAEHV_OPAQUE"], "srun_args": ["--cpu-bind=none"], "sbatch_args": {"mail-type": "END"},
    "array_parallelism": 2, "job_dir": "/shared/alice/runs", "python": "/opt/py/bin/python3", "device": "cpu",
    "dist_backend": "gloo", "rendezvous_timeout_s": 99, "collective_timeout_s": 1234, "torch_threads": 5,
    "gpu_memory_gb": 40, "group": "taehvgroup", "check_data_on_submit": False, "data_check_budget_s": 0.0,
    "compile_cache_dir": "/shared/alice/cache", "restart_in_allocation": False, "spare_nodes": 1,
    "min_nodes": 2, "container_image": "/shared/images/torch.sif", "container_runtime": "apptainer",
    "container_mounts": ["/shared:/shared"], "container_python": "/usr/bin/python3.11",
    "requeue": "follow_up", "code_snapshot": False,
}


@dataclasses.dataclass
class Seen:
    """What one probe config becomes: the sbatch script of a 3-run sweep, the task every rank runs, the
    settings the trainer gets, the executor, and the submit-time checks of a video config."""

    cfg: ClusterConfig
    script: str
    task: Any
    runtime: Any
    executor: Any
    rows: dict[str, Any]

    def variant(self, **changes: Any) -> Seen:
        return seen(load_cluster({**PROBE, **changes}), self.script_folder)

    script_folder: Path = Path("/shared/alice/runs/run1/submitit")


def seen(cfg: ClusterConfig, folder: Path) -> Seen:
    video = load_train({"data": {"source": "video", "path": str(folder.parent), "frames": 8, "height": 48,
                                 "width": 64}})
    rows = {r.check: r for r in submit_checks(cfg, [video], [plan_for(1, 1, video, device="cpu")], [])}
    return Seen(cfg, sbatch_preview(cfg, folder, array_size=3),
                requeueable_task(lambda ctx: None, folder.parent, cfg, SlurmBackend()), cfg.runtime(),
                make_executor(cfg, folder), rows, folder)


def _in_sbatch_environ(s: Seen, name: str) -> bool:
    with secrets_in_environ(s.cfg):
        return os.environ.get(name) == PROBE["env"][name]


ONE_MACHINE = {"nodes": 1, "min_nodes": None, "spare_nodes": 0,  # what the local and debug backends take
               "container_image": None, "container_mounts": []}

REACHES = {
    "name": lambda s: "#SBATCH --job-name=tv" in s.script,
    "backend": lambda s: (isinstance(s.executor, SlurmExecutor)
                          and isinstance(s.variant(**ONE_MACHINE, backend="local").executor, LocalExecutor)
                          and isinstance(s.variant(**ONE_MACHINE, backend="debug").executor,
                                         submitit.DebugExecutor)),
    **{key: (lambda s, key=key: f"#SBATCH --{key}={PROBE[key]}" in s.script)
       for key in ("partition", "account", "qos", "constraint")},
    # the ranks' first step on `nodes` of the allocation, which holds `spare_nodes` more
    "nodes": lambda s: f"taehv_slurm.runtime.steps first {s.script_folder} 3 3 " in s.script,
    "spare_nodes": lambda s: "#SBATCH --nodes=4" in s.script,
    "restart_in_allocation": lambda s: all(
        ("TAEHV_STEP_LOOP=1" in v.script) == ("--no-kill" in v.script) == on
        for on in (False, True) for v in [s.variant(restart_in_allocation=on)]),
    "min_nodes": lambda s: f"taehv_slurm.runtime.steps first {s.script_folder} 3 3 2 " in s.script,
    "gpus_per_node": lambda s: "#SBATCH --gres=gpu:6" in s.variant(gres=None).script,
    "tasks_per_node": lambda s: "#SBATCH --ntasks-per-node=3" in s.script,
    "allow_task_gpu_mismatch": lambda s: _refused(allow_task_gpu_mismatch=False),
    "gres": lambda s: "#SBATCH --gres=gpu:h100:6" in s.script,
    "cpus_per_task": lambda s: "#SBATCH --cpus-per-task=11" in s.script and s.runtime.cpus_per_task == 11,
    "mem_gb": lambda s: "#SBATCH --mem=480GB" in s.script,
    "time_min": lambda s: "#SBATCH --time=77" in s.script,
    "exclusive": lambda s: "#SBATCH --exclusive" in s.script,
    "signal_delay_s": lambda s: "#SBATCH --signal=USR2@123" in s.script and s.task.grace_s["timeout"] == 113,
    "kill_wait_s": lambda s: s.task.grace_s["preempted"] == 42,  # KillWait less the exit's margin
    "max_requeues": lambda s: s.task.guards.max_requeues == 5 and s.executor.max_num_timeout == 5,
    "max_requeues_without_progress": lambda s: s.task.guards.max_requeues_without_progress == 4,
    "requeue_on_failure": lambda s: s.task.requeue_on_failure is False,
    "exclude_failed_nodes": lambda s: s.task.exclude_failed_nodes is False,
    "hang_detection": lambda s: s.task.watchdog.enabled is False,
    "heartbeat_s": lambda s: s.task.watchdog.interval_s == 7,
    "hang_floor_s": lambda s: s.task.watchdog.floor_s == 90,
    "hang_factor": lambda s: s.task.watchdog.factor == 4,
    "hang_uncalibrated_s": lambda s: s.task.watchdog.uncalibrated_s == 900,
    "slow_rank_margin": lambda s: s.runtime.slow_rank_margin == 0.7,
    "slow_rank_windows": lambda s: s.runtime.slow_rank_windows == 9,
    "setup": lambda s: "\nmodule load cuda/12.4\n" in s.script,
    "env": lambda s: ("export NCCL_SOCKET_IFNAME=ib0" in s.script and "hf_supersecret" not in s.script
                      and _in_sbatch_environ(s, "HF_TOKEN")),
    "secret_env": lambda s: "opaque-value" not in s.script and _in_sbatch_environ(s, "TAEHV_OPAQUE"),
    "srun_args": lambda s: "--kill-on-bad-exit=1" not in s.script and " --cpu-bind=none " in s.script,
    "sbatch_args": lambda s: "#SBATCH --mail-type=END" in s.script,
    "array_parallelism": lambda s: "#SBATCH --array=0-2%2" in s.script,
    "job_dir": lambda s: ("export TAEHV_COMPILE_CACHE=/shared/alice/runs/compile-cache"
                          in s.variant(compile_cache_dir=None).script),
    # the batch script's own steps, outside the image (the ranks' interpreter is the image's)
    "python": lambda s: ("/opt/py/bin/python3 -m taehv_slurm.relay start" in s.script
                         and s.script.count("/opt/py/bin/python3 -u -m taehv_slurm.runtime.entry") == 1
                         and s.variant(container_image=None, container_mounts=[]).script.count(
                             "/opt/py/bin/python3 -u -m taehv_slurm.runtime.entry") == 2),
    "container_image": lambda s: (" /shared/images/torch.sif /usr/bin/python3.11 " in s.script
                                  and s.rows["container"].result == "FAIL"),  # no such image here
    "container_runtime": lambda s: ("srun --unbuffered" in s.script and " apptainer exec --nv " in s.script
                                    and "--container-image=/shared/images/torch.sif" in
                                    s.variant(container_runtime="pyxis").script),
    "container_mounts": lambda s: " --bind /shared:/shared " in s.script,
    "container_python": lambda s: "/usr/bin/python3.11 -u -m taehv_slurm.runtime.entry" in s.script,
    "requeue": lambda s: ("#SBATCH --no-requeue" in s.script
                          and "#SBATCH --requeue" in s.variant(requeue="auto").script),
    "code_snapshot": lambda s: (snapshot.job_env(s.cfg, copy=False) == {}
                                and "PYTHONPATH" in snapshot.job_env(s.variant(code_snapshot=True).cfg,
                                                                     copy=False)),
    "device": lambda s: s.runtime.device == "cpu",
    "dist_backend": lambda s: s.runtime.dist_backend == "gloo",
    "rendezvous_timeout_s": lambda s: s.runtime.rendezvous_timeout_s == 99,
    "collective_timeout_s": lambda s: s.runtime.collective_timeout_s == 1234,
    "torch_threads": lambda s: s.runtime.torch_threads == 5,
    "gpu_memory_gb": lambda s: s.runtime.gpu_memory_gb == 40,
    "group": lambda s: "export TAEHV_SHARED_GROUP=taehvgroup" in s.script,
    "check_data_on_submit": lambda s: s.rows["data"].result == "SKIP",
    # the job's readers on a sample, within the budget: of 0 s, listing stops before the first folder (the
    # default 10 s reads the one good video there)
    "data_check_budget_s": lambda s: s.variant(check_data_on_submit=True).rows["data"].detail.startswith(
        "none of 0 sampled file(s) under "),
    "compile_cache_dir": lambda s: (s.runtime.compile_cache_dir == "/shared/alice/cache"
                                    and "export TAEHV_COMPILE_CACHE=/shared/alice/cache" in s.script),
}


def _refused(**changes: Any) -> bool:
    try:
        load_cluster({**PROBE, **changes})
    except ConfigError:
        return True
    return False


def test_every_cluster_field_reaches_the_script_or_the_job(tmp_path: Path) -> None:
    """Each field of the cluster config, set away from its default, shows where it must act; a field
    added without a place here fails the test."""
    assert set(REACHES) == {f.name for f in dataclasses.fields(ClusterConfig)}
    defaults = ClusterConfig()
    assert all(getattr(load_cluster(PROBE), k) != getattr(defaults, k) for k in PROBE if k != "backend")
    videos = tmp_path / "videos"
    videos.mkdir()
    write_video(videos / "clip.mp4", 12, 64, 48)
    probe = seen(load_cluster(PROBE), videos / "submitit")
    missed = [key for key, check in REACHES.items() if not check(probe)]
    assert not missed, f"not found where they act: {missed}\n{probe.script}"
    assert "HF_TOKEN" not in probe.script and "TAEHV_OPAQUE" not in probe.script


def test_secrets_are_masked() -> None:
    cfg = load_cluster({"env": {"WANDB_API_KEY": "k-123", "MY_VAR": "x", "OTHER": "y"},
                        "secret_env": ["OTHER"]})
    assert cfg.secret_names() == {"WANDB_API_KEY", "OTHER"}
    assert cfg.masked()["env"] == {"WANDB_API_KEY": "***", "MY_VAR": "x", "OTHER": "***"}
    assert cfg.without_secrets().env == {"MY_VAR": "x"}
