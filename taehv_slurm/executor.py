"""Cluster config → a submitit executor, and the exact sbatch script it would write.

One task per GPU (`--ntasks-per-node = gpus_per_node`, `--gres=gpu:N`) so local ranks never exceed
the GPUs of a node; USR2 `signal_delay_s` before the time limit so the job can save and requeue;
`--requeue` so a preempted job comes back even where the cluster's default is not to requeue.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import submitit

from taehv_slurm import container
from taehv_slurm.backends import backend_named
from taehv_slurm.common.config import ClusterConfig
from taehv_slurm.common.machine import gpus_here, visible_gpus
from taehv_slurm.common.submitit_api import convert_mem, make_sbatch_string
from taehv_slurm.runtime import controller
from taehv_slurm.runtime.bytecode import COMPILE_CACHE_ENV
from taehv_slurm.runtime.distenv import INHERITED_LAUNCHER_VARS
from taehv_slurm.runtime.steps import JOB_ENDING_ENV, LAUNCH_ENV, RESTART_EXIT_CODE, STEP_LOOP_ENV
from taehv_slurm.slurm import NO_SLURM_HINT, SCONTROL_ENV, munge_trouble, says_no_slurm

RELAY_LINGER_MARGIN_S = 30  # the relay outlives a batch script a signal ended by KillWait + this
CONTROLLER_START_S = 120  # the setup lines (module loads, a venv) run before the local controller starts


def entry_command(python: str, folder: Path, run_dir: Path | None = None, after: str | None = None) -> str:
    """Each task's command: our entry point checks who can write the job folder before submitit loads
    its pickle (run_dir: the folder the run owns, checked strictly; default the job folder). With
    `after` (a shell word for srun's exit status): the same entry point once every rank ended."""
    return " ".join([python, "-u -m taehv_slurm.runtime.entry", *(["--after", after] if after else []),
                     shlex.quote(str(folder)), *([shlex.quote(str(run_dir))] if run_dir is not None else [])])


def step_loop(python: str, folder: Path, run_dir: Path | None, cluster: ClusterConfig) -> str:
    """The sbatch script's command: the job's Slurm relay (taehv_slurm.relay: the ranks' Slurm commands
    run here, outside any container), then the ranks as a job step on `nodes` of the allocation (in the
    cluster's container image, if any); once every rank ended, the entry point records what the ranks could
    not (ranks killed from outside) and answers either the job's exit status, or RESTART_EXIT_CODE: the
    ranks start again inside the allocation, on the nodes it wrote for the next step
    (taehv_slurm.runtime.steps, .restart). Without restart_in_allocation the loop runs once and a fault
    requeues the job."""
    out = shlex.quote(str(folder)) + "/"
    srun = shlex.join(["srun", "--unbuffered", *cluster.srun_args]) + container.srun_flags(cluster)
    loop_env = f"{STEP_LOOP_ENV}=1 " if cluster.restart_in_allocation else ""
    ranks = container.rank_command(cluster, entry_command(container.ranks_python(cluster, python), folder,
                                                          run_dir))
    after = entry_command(python, folder, run_dir, after='"$srun_status"')
    return "\n".join([
        # A SIGTERM to every process of the job (a requeue, PreemptMode=CANCEL, scancel --full) must not end
        # the script before its ranks have saved and said how the run goes on: the job would end, and its
        # ranks with it. It tells the step after them that Slurm is ending the job.
        f"trap 'export {JOB_ENDING_ENV}=1' TERM",
        f"relay=$({python} -m taehv_slurm.relay start {shlex.quote(str(folder))} $$ "
        f'{cluster.kill_wait_s + RELAY_LINGER_MARGIN_S}) || exit 1; eval "$relay"',
        *container.script_lines(cluster),
        f"export {loop_env}{LAUNCH_ENV}=0",
        # an array task is ARRAY_TASK to Slurm's commands and to submitit, and names its logs so
        'job=$SLURM_JOB_ID; [ -n "$SLURM_ARRAY_JOB_ID" ] && job=${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID',
        f'log={out}%j_%t_log.out; [ -n "$SLURM_ARRAY_JOB_ID" ] && log={out}%A_%a_%t_log.out',
        f"{python} -m taehv_slurm.runtime.steps first {shlex.quote(str(folder))} {cluster.nodes} "
        f"{cluster.tasks_per_node} {cluster.fewest_nodes} || taehv_exit 1",
        "while :; do",
        f'  {srun} --output "$log" $(cat {out}"$job"_srun_args) {ranks}',
        "  srun_status=$?",
        f"  {after}",
        "  after_status=$?",
        f'  [ "$after_status" = {RESTART_EXIT_CODE} ] || taehv_exit "$after_status"',
        f"  export {LAUNCH_ENV}=$(( {LAUNCH_ENV} + 1 ))",
        "done",
    ])


class LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor, started under our controller with `command` as each rank's command."""

    def __init__(self, folder: str | Path, command: str, grace_s: float, max_restarts: int,
                 python: str) -> None:
        super().__init__(folder, max_num_timeout=max_restarts, python=python)
        self.command = command
        self.grace_s = grace_s
        self.max_restarts = max_restarts

    @property
    def _submitit_command_str(self) -> str:
        return self.command

    def _submit_command(self, command: str) -> submitit.LocalJob:
        ntasks = int(self.parameters.get("tasks_per_node", 1))
        gpus = int(self.parameters.get("gpus_per_node", 0))
        started = controller.start_mark()
        environ = {
            **os.environ,
            "SUBMITIT_EXECUTOR": "local",
            "SUBMITIT_LOCAL_NTASKS": str(ntasks),
            "SUBMITIT_LOCAL_COMMAND": command,
            "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * float(self.parameters.get("timeout_min", 60)))),
            "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
            "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "CUDA_VISIBLE_DEVICES": ",".join(visible_gpus()[:gpus]),  # the user's CUDA_VISIBLE_DEVICES holds
            "TAEHV_LOCAL_GRACE_S": str(self.grace_s),
            "TAEHV_LOCAL_MAX_RESTARTS": str(self.max_restarts),
            "TAEHV_LOCAL_STARTED": started,
        }
        argv = [sys.executable, "-m", "taehv_slurm.runtime.controller", str(self.folder)]
        setup = list(self.parameters.get("setup", ()))
        run: list[str] | str = argv
        if setup:  # exec: the controller keeps the shell's pid, which is the job id
            run = " && ".join([*setup, "exec " + shlex.join(argv)])
        with open(self.folder / "local_controller.log", "ab") as log:
            process = subprocess.Popen(run, shell=bool(setup), env=environ, stdout=log,
                                       stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        # Returned once the controller has recorded its first state (or has died, e.g. a failing setup
        # line): from then on its state is known to any process that asks.
        job_id = controller.local_job_id(process.pid, started)
        deadline = time.monotonic() + CONTROLLER_START_S
        while not controller.state_path(self.folder, job_id).exists() and process.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        return submitit.LocalJob(folder=self.folder, job_id=job_id, process=process,
                                 tasks=list(range(ntasks)))


class SlurmExecutor(submitit.SlurmExecutor):
    def __init__(self, folder: Path, command: str, ranks: int, **kwargs: Any) -> None:
        super().__init__(folder, **kwargs)
        self.command = command
        self.ranks = ranks

    @property
    def _submitit_command_str(self) -> str:
        return self.command

    def _num_tasks(self) -> int:
        return self.ranks  # the ranks that run: the allocation's spare nodes run none


def setup_lines(cluster: ClusterConfig, extra_env: Mapping[str, str] | None = None) -> list[str]:
    """Shell lines run before the tasks start: the job's env (never a secret), then the user's setup."""
    env = {**(extra_env or {}), COMPILE_CACHE_ENV: str(cluster.runtime().compile_cache_dir),
           **cluster.public_env()}  # the user's env wins over the plan's
    if cluster.group:
        env["TAEHV_SHARED_GROUP"] = cluster.group
    # A job submitted from inside a launched process (a notebook under torchrun) must not inherit its rank.
    lines = [f"unset {' '.join(INHERITED_LAUNCHER_VARS)}"]
    # found before the setup lines: PATH cannot hide it
    if backend_named(cluster.backend).writes_sbatch_script:
        lines.append(f'export {SCONTROL_ENV}="${{{SCONTROL_ENV}:-$(command -v scontrol)}}"')
    return (lines + [f"export {name}={shlex.quote(str(value))}" for name, value in env.items()]
            + list(cluster.setup))


def slurm_parameters(cluster: ClusterConfig, extra_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (names of its sbatch writer) for every cluster field."""
    params: dict[str, Any] = {
        "array_parallelism": cluster.array_parallelism,
        "job_name": cluster.name,
        "time": cluster.time_min,
        "nodes": cluster.nodes + cluster.spare_nodes,  # the ranks' step runs on `nodes` of them
        "ntasks_per_node": cluster.tasks_per_node,
        "cpus_per_task": cluster.cpus_per_task,
        "signal_delay_s": cluster.signal_delay_s,
        "stderr_to_stdout": True,  # one log per rank: <job>_<rank>_log.out
        "setup": setup_lines(cluster, extra_env),
        "use_srun": False,  # the command starts the ranks itself (`step_loop`)
        # --no-kill: a node that fails does not end the job, which then restarts its ranks without it
        # follow_up: Slurm must not requeue the job too (its next attempt is a job of its own)
        "additional_parameters": {("no-requeue" if cluster.requeue == "follow_up" else "requeue"): True,
                                  **({"no-kill": True} if cluster.restart_in_allocation else {}),
                                  **cluster.sbatch_args},
    }
    optional = {
        "partition": cluster.partition,
        "account": cluster.account,
        "qos": cluster.qos,
        "constraint": cluster.constraint,
        "gres": cluster.gres_request,
        "mem": convert_mem(cluster.mem_gb) if cluster.mem_gb else None,
        "exclusive": True if cluster.exclusive else None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def make_executor(cluster: ClusterConfig, folder: str | Path, extra_env: Mapping[str, str] | None = None,
                  run_dir: str | Path | None = None) -> submitit.Executor:
    """A submitit executor for `cluster.backend` with every field applied.

    slurm: sbatch on the cluster; local: real processes on this machine (one per task, like one
    node), under a controller that ends in Slurm's states (taehv_slurm.runtime.controller); debug: in
    this process, for stepping through with a debugger. run_dir: the folder the run owns, if not
    `folder` itself.
    """
    folder = Path(folder)
    python = cluster.python or shlex.quote(sys.executable)
    owner = Path(run_dir) if run_dir is not None else None
    command = entry_command(python, folder, owner)
    return _EXECUTORS[cluster.backend](cluster, folder, command, python, extra_env, owner)


def _slurm_executor(cluster: ClusterConfig, folder: Path, command: str, python: str,
                    extra_env: Mapping[str, str] | None, run_dir: Path | None) -> submitit.Executor:
    executor = SlurmExecutor(folder, step_loop(python, folder, run_dir, cluster), cluster.world_size,
                             max_num_timeout=cluster.max_requeues, python=python)
    executor.update_parameters(**slurm_parameters(cluster, extra_env))
    return executor


def _local_executor(cluster: ClusterConfig, folder: Path, command: str, python: str,
                    extra_env: Mapping[str, str] | None, run_dir: Path | None) -> submitit.Executor:
    executor = LocalExecutor(folder, command, grace_s=float(cluster.kill_wait_s),
                             max_restarts=cluster.max_requeues + 1, python=python)
    executor.update_parameters(
        timeout_min=cluster.time_min,
        tasks_per_node=cluster.tasks_per_node,
        gpus_per_node=cluster.gpus_per_node if gpus_here() else 0,
        signal_delay_s=cluster.signal_delay_s,
        stderr_to_stdout=True,
        setup=setup_lines(cluster, extra_env),
    )
    return executor


def _debug_executor(cluster: ClusterConfig, folder: Path, command: str, python: str,
                    extra_env: Mapping[str, str] | None, run_dir: Path | None) -> submitit.Executor:
    return submitit.DebugExecutor(folder)


_EXECUTORS = {"slurm": _slurm_executor, "local": _local_executor, "debug": _debug_executor}


def sbatch_preview(cluster: ClusterConfig, folder: str | Path, extra_env: Mapping[str, str] | None = None,
                   run_dir: str | Path | None = None, array_size: int = 1) -> str:
    """The exact sbatch script `make_executor(cluster, folder, extra_env, run_dir)` submits for one job, or
    for a job array of `array_size` runs (a sweep); secrets never appear in it."""
    folder = Path(folder)
    python = cluster.python or shlex.quote(sys.executable)
    owner = Path(run_dir) if run_dir is not None else None
    array = {"map_count": array_size} if array_size > 1 else {}
    return make_sbatch_string(command=step_loop(python, folder, owner, cluster), folder=folder,
                              **slurm_parameters(cluster, extra_env), **array)


class SubmissionError(RuntimeError):
    """The scheduler rejected the job; the message is sbatch's reason and the config field to fix."""


_SBATCH_FIXES = (
    ("invalid partition", "set partition in the cluster config to one that `sinfo -s` lists"),
    ("requested node configuration is not available",
     "no node offers that many GPUs/CPUs/memory: check gpus_per_node (gres), cpus_per_task × tasks_per_node "
     "and mem_gb against `sinfo -o '%P %D %c %m %G'`"),
    ("invalid generic resource",
     "the cluster has no such GRES: check gres / gpus_per_node against `sinfo -o '%G'`"),
    ("more processors requested than permitted", "lower cpus_per_task or tasks_per_node"),
    ("node count specification invalid", "the partition has fewer nodes than requested: lower nodes"),
    ("invalid account", "set account to one `sacctmgr show assoc user=$USER` lists"),
    ("invalid qos", "set qos to one your account may use (`sacctmgr show assoc user=$USER format=qos`)"),
    ("time limit", "lower time_min below the partition's limit (`sinfo -o '%P %l'`)"),
)


def describe_sbatch_error(text: str) -> str:
    """sbatch's own error line plus the fix, from the error text submitit collected."""
    if says_no_slurm(text):
        return NO_SLURM_HINT
    if trouble := munge_trouble(text):
        return f"sbatch could not submit the job: {trouble}"
    lines = [ln.strip() for ln in text.splitlines() if "error:" in ln.lower()]
    reason = (lines[-1].split("error:", 1)[-1].strip() if lines
              else text.strip().splitlines()[-1] if text.strip() else "unknown")
    for needle, fix in _SBATCH_FIXES:
        if needle in reason.lower():
            return f"sbatch rejected the job: {reason}; {fix}"
    return f"sbatch rejected the job: {reason}"


