"""Preflight: check a cluster before a long run — configs, plan, dependencies, data, checkpoint space,
Slurm's partition, nodes and settings (taehv_slurm.slurm_checks; `not checked here` where there is no
Slurm), and (optionally) a short job on the nodes. Each check adds rows
(check, PASS | FAIL | WARN | SKIP, detail); every FAIL names what to change. `taehv preflight`
prints them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from taehv_slurm import slurm
from taehv_slurm.backends import backend_named
from taehv_slurm.common.config import ClusterConfig, ConfigError, TrainConfig, load_cluster, load_train
from taehv_slurm.common.plan import plan_for_cluster, taehv_param_count
from taehv_slurm.common.security import UnsafePathError, check_not_shared_writable
from taehv_slurm.executor import SubmissionError
from taehv_slurm.runtime import network
from taehv_slurm.runtime.smoke import SmokeTask
from taehv_slurm.slurm_checks import not_checked_rows, slurm_rows
from taehv_slurm.submit_checks import Row, container_rows, data_row


@dataclasses.dataclass
class PreflightOptions:
    job: bool = False  # also run a short job on the nodes (smoke task + bandwidth)
    bandwidth_mib: tuple[int, ...] = (1, 16, 128)  # all-reduce message sizes of the job
    min_bus_gbps: float = 0.0  # FAIL below this bus bandwidth at the largest size
    job_timeout_s: float = 900.0  # queue + run
    sample_clips: int = 8  # video files (or prepared clips) the dataset check reads
    data_budget_s: float = 60.0  # the dataset check's time (the trainer's readers on a sample)
    origins: Mapping[str, str] | None = None  # config key → the flag that set it (load_cluster's origins)


class Preflight:
    """Run the checks in order; each adds rows, and a check whose inputs failed is SKIPped."""

    def __init__(self, cluster_source: str, train_source: str, cluster_overrides: dict[str, Any],
                 train_overrides: dict[str, Any], options: PreflightOptions | None = None) -> None:
        self.sources = (cluster_source, train_source)
        self.overrides = (cluster_overrides, train_overrides)
        self.options = options or PreflightOptions()
        self.rows: list[Row] = []
        self.cluster: ClusterConfig | None = None
        self.train: TrainConfig | None = None
        self.plan: Any = None
        self.no_slurm: str | None = None  # why Slurm cannot be reached from here: its rows are not checked

    def add(self, check: str, result: str, detail: str) -> None:
        self.rows.append(Row(check, result, detail))

    @property
    def failed(self) -> list[str]:
        return [r.check for r in self.rows if r.result == "FAIL"]

    def run(self) -> list[Row]:
        self.check_configs()
        self.check_plan()
        self.check_dependencies()
        self.check_dataset()
        self.check_job_dir()
        self.check_slurm()
        if self.options.job:
            self.check_job()
        return self.rows

    # --------------------------------------------------------------------------------- configs
    def check_configs(self) -> None:
        (cluster_source, train_source), (cluster_over, train_over) = self.sources, self.overrides
        try:
            self.cluster = c = load_cluster(cluster_source, origins=self.options.origins, **cluster_over)
            self.add("cluster config", "PASS",
                     f"{cluster_source}: {c.backend}, partition {c.partition or '(default)'}, "
                     f"{c.nodes} node(s) × {c.tasks_per_node} tasks, gres {c.gres_request or 'none'}, "
                     f"{c.cpus_per_task} CPUs/task, "
                     f"device {c.device}")
            self.rows += container_rows(c)
        except ConfigError as err:
            self.add("cluster config", "FAIL", str(err))
        try:
            self.train = t = load_train(train_source, origins=self.options.origins, **train_over)
            self.add("train config", "PASS", f"{train_source}: {t.name}, {t.steps} steps, "
                                             f"data {t.data.source}, "
                                             f"effective batch {t.batch.effective}")
        except ConfigError as err:
            self.add("train config", "FAIL", str(err))

    def check_plan(self) -> None:
        if self.cluster is None or self.train is None:
            self.add("plan", "SKIP", "needs valid cluster and train configs")
            return
        try:
            self.plan = p = plan_for_cluster(self.cluster, self.train)
        except ConfigError as err:
            self.add("plan", "FAIL", str(err))
            return
        self.add("plan", "PASS", f"{p.world_size} GPUs = {p.num_nodes} × {p.gpus_per_node}: "
                                 f"{p.split_text()}; "
                                 f"engine {p.engine}; ≈{p.memory_per_gpu_gb:.1f} GB per GPU")

    # ---------------------------------------------------------------------------- dependencies
    def check_dependencies(self) -> None:
        t = self.train
        needed = {"torch": "always", "submitit": "always", "yaml": "always", "pandas": "always",
                  "numpy": "always", "hostlist": "always", "tensorboard": "rank 0's metrics"}
        wanted = {"deepspeed": "ZeRO engines", "av": "video data", "safetensors": ".safetensors weights",
                  "diffusers": "CogVideoX and Wan teachers"}
        if self.plan is not None and self.plan.engine.startswith("zero"):
            needed["deepspeed"] = f"engine {self.plan.engine}"
        if t is not None and t.data.source == "video":
            needed["av"] = "data.source video"
        kind = t.teacher.kind if t is not None else "none"
        if kind not in ("none", "hunyuanvideo"):  # HunyuanVideo's encoder is our own, read from safetensors
            needed["diffusers"] = f"teacher.kind {kind}"
        if kind == "hunyuanvideo" and not str(t.teacher.path).startswith("random:"):
            needed["safetensors"] = "teacher.kind hunyuanvideo"
        if t is not None and (t.model.init_from or "").endswith(".safetensors"):
            needed["safetensors"] = "model.init_from"
        extra = [n for n in wanted if n not in needed]
        names = list(needed) + extra
        # what this config needs is imported, as a rank would; the rest only shows its installed version
        found, problem = _import_versions(list(needed), extra)
        if problem:
            self.add("dependencies", "FAIL", problem)
            return
        missing = [f"{n} ({found[n]['error']}; needed for {needed[n]})" for n in needed
                   if "error" in found[n]]
        optional = [n for n in extra if "error" in found[n]]
        versions = ", ".join(f"{'PyYAML' if n == 'yaml' else n} {found[n]['version']}" for n in names
                             if "version" in found[n])
        torch_info = found.get("torch", {})
        cuda = (f"; torch CUDA {torch_info.get('cuda') or 'none'}, "
                f"{torch_info.get('gpus', 0)} GPU(s) on this machine"
                if "version" in torch_info else "")
        if missing:
            self.add("dependencies", "FAIL", f"missing: {'; '.join(missing)}; "
                                             "install them in the job's environment "
                                             f"(pip install -e . installs all)")
        else:
            note = f"; not installed (not needed by this config): {', '.join(optional)}" if optional else ""
            self.add("dependencies", "PASS", versions + cuda + note)

    # --------------------------------------------------------------------------------- dataset
    def check_dataset(self) -> None:
        t = self.train
        if t is None:
            self.add("dataset", "SKIP", "needs a valid train config")
            return
        d = t.data
        if d.source == "synthetic":
            self.add("dataset", "SKIP", "data.source synthetic: clips are generated, nothing to read")
            return
        row = data_row(t, self.options.data_budget_s, self.options.sample_clips)
        self.add("dataset", row.result, row.detail)

    # ------------------------------------------------------------------------ checkpoint folder
    def check_job_dir(self) -> None:
        c, t = self.cluster, self.train
        if c is None or t is None:
            self.add("checkpoint folder", "SKIP", "needs valid cluster and train configs")
            return
        job_dir = Path(c.job_dir)
        # Nothing is left behind: a folder that does not exist yet is not created (the first submit does),
        # its nearest existing parent is probed instead, with a file that is removed again.
        probed = next(p for p in (job_dir, *job_dir.absolute().parents) if p.exists())
        if probed == job_dir:
            try:
                check_not_shared_writable(job_dir)  # submit's own refusal, in its words
            except UnsafePathError as err:
                self.add("checkpoint folder", "FAIL", str(err))
                return
        try:
            with tempfile.NamedTemporaryFile(dir=probed, prefix=".preflight-") as probe:
                probe.write(b"\0" * 2**20)
                probe.flush()
                os.fsync(probe.fileno())
        except OSError as err:
            self.add("checkpoint folder", "FAIL",
                     f"{job_dir} is not writable ({err.strerror or err}): "
                     "set job_dir in the cluster config to a folder "
                     "you can write, on storage every node sees")
            return
        world = c.nodes * int(c.tasks_per_node or 1)
        # Full fp32 weights + two AdamW moments (12 bytes per parameter), plus each rank's RNG states.
        size = 12 * taehv_param_count(t) + 32 * 1024 * world + 64 * 1024
        keep = t.intervals.keep_checkpoints
        need = (keep + 1) * size  # a new checkpoint is complete before the oldest is removed
        free = shutil.disk_usage(probed).free
        where = job_dir if probed == job_dir else f"{job_dir} (to be created in {probed})"
        detail = (f"{where} writable; {_size(free)} free, {keep} checkpoints of ≈{_size(size)} "
                  f"(+1 while saving) need {_size(need)}")
        if free < need:
            self.add("checkpoint folder", "FAIL", f"{detail}: free space there, "
                                                  "lower intervals.keep_checkpoints "
                                                  "or move job_dir")
        else:
            self.add("checkpoint folder", "PASS", detail)

    # ----------------------------------------------------------------------------------- Slurm
    def check_slurm(self) -> None:
        c = self.cluster
        if c is None:
            self.add("partition", "SKIP", "needs a valid cluster config")
            return
        backend = backend_named(c.backend)
        if backend.runs_here:
            self.add("partition", "SKIP", f"backend {c.backend}: runs on this machine, no Slurm")
            return
        self.no_slurm = backend.unavailable_reason()
        self.rows += not_checked_rows(c, self.no_slurm) if self.no_slurm else slurm_rows(c)

    # ------------------------------------------------------------------------------------- job
    def check_job(self) -> None:
        c = self.cluster
        if self.failed or c is None:
            self.add("job", "SKIP",
                     f"fix the failed rows first ({', '.join(self.failed) or 'cluster config'})")
            return
        from taehv_slurm.submission import submit

        sizes = self.options.bandwidth_mib
        backend = "gloo" if c.device == "cpu" else c.dist_backend
        task = SmokeTask(backend=backend, rendezvous_timeout_s=min(c.rendezvous_timeout_s, 300),
                         timeout_s=300,
                         bandwidth_mib=sizes)
        job_cluster = dataclasses.replace(c, name=f"{c.name}-preflight", time_min=min(c.time_min, 30),
                                          signal_delay_s=min(c.signal_delay_s, 60), max_requeues=0).validate()
        start = time.monotonic()
        try:
            handle = submit(task, job_cluster, f"preflight-{time.strftime('%Y%m%d-%H%M%S')}",
                            requeueable=False,
                            record={"task_kind": "preflight"})
        except SubmissionError as err:
            self.add("job", "FAIL", str(err))
            return
        try:
            state = handle.wait(timeout_s=self.options.job_timeout_s, poll_s=1.0, progress=False)
        except TimeoutError:
            reason = slurm.squeue_reason(handle.job_id)
            handle.cancel()
            self.add("job", "FAIL", f"job {handle.job_id} did not finish "
                                    f"within {self.options.job_timeout_s:.0f} s "
                                    f"({reason}); cancelled it")
            return
        elapsed = time.monotonic() - start
        facts: list[dict[str, Any]] = []
        if state.split()[0] == "COMPLETED":
            try:
                facts = [f for f in handle.results() if isinstance(f, dict)]
            except Exception as err:  # a rank failed: submitit raises with that rank's traceback
                state = f"{state} (a rank failed: {_last_error_line(str(err))})"
        if not facts:
            self.add("job", "FAIL", f"job {handle.job_id} ended {state}; "
                                    f"rank 0's log: {handle.log_path(0)} — "
                                    f"{_last_error_line(handle.tail(40)) or 'empty'}")
            return
        self.add("job", "PASS", f"job {handle.job_id} {state} in {elapsed:.0f} s (queue + run); "
                                "results came back "
                                "through job_dir, so the nodes share it")
        self._job_rows(facts, job_cluster, sizes)

    def _job_rows(self, facts: list[dict[str, Any]], c: ClusterConfig, sizes: tuple[int, ...]) -> None:
        world = c.nodes * int(c.tasks_per_node or 1)
        ranks = sorted(f["rank"] for f in facts)
        wrong = [f["rank"] for f in facts if f["sum"] != f["expected_sum"]]
        slowest = max(f["rendezvous_s"] for f in facts)
        ok = ranks == list(range(world)) and not wrong
        self.add("rendezvous", "PASS" if ok else "FAIL",
                 f"{len(ranks)}/{world} ranks joined (slowest {slowest:.1f} s) and all-reduced the right sum"
                 if ok else f"ranks reporting: {len(ranks)}/{world}; wrong all-reduce sum on ranks {wrong}")
        hosts: dict[str, list[dict[str, Any]]] = {}
        for f in facts:
            hosts.setdefault(f["host"], []).append(f)
        if len(hosts) != c.nodes:
            self.add("nodes (job)", "FAIL",
                     f"the job ran on {len(hosts)} host(s), expected {c.nodes}: {', '.join(hosts)}")
        for host, mine in sorted(hosts.items()):
            result, gpus = self._gpu_check(mine, c)
            tasks_ok = len(mine) == c.tasks_per_node
            lo, hi = min(f["rank"] for f in mine), max(f["rank"] for f in mine)
            driver = mine[0].get("driver") or "none (no NVIDIA driver)"
            detail = (f"ranks {lo}-{hi} ({len(mine)} "
                      f"tasks{'' if tasks_ok else f', expected {c.tasks_per_node}'}); "
                      f"{gpus}; driver {driver}; torch {mine[0].get('torch')}")
            self.add(f"node {host}", result if tasks_ok else "FAIL", detail)
        for size in sizes:
            values = [f["bus_bandwidth_gbps"].get(size, f["bus_bandwidth_gbps"].get(str(size)))
                      for f in facts]
            values = [v for v in values if v is not None]
            low = min(values) if values else 0.0
            floor = self.options.min_bus_gbps if size == max(sizes) else 0.0
            result = "FAIL" if not values or low < floor else "PASS"
            self.add(f"all-reduce {size} MiB", result,
                     f"bus bandwidth {low:.3g} GB/s (slowest rank; {world} ranks over {c.nodes} node(s), "
                     f"{facts[0]['backend']})" + (f"; below --min-bus-gbps {floor:g}" if low < floor else ""))
        self._network_row(facts, sizes)

    def _network_row(self, facts: list[dict[str, Any]], sizes: tuple[int, ...]) -> None:
        """What the collectives travel over between the nodes, as the library chose it, with the largest
        size's bus bandwidth; WARN where a node has InfiniBand devices and NCCL chose sockets."""
        first = next((f for f in facts if f.get("network")), None)
        if first is None:
            return
        speed = min((f["bus_bandwidth_gbps"].get(max(sizes), f["bus_bandwidth_gbps"].get(str(max(sizes))))
                     or 0.0 for f in facts), default=None) if sizes else None
        measured = f"; {speed:.3g} GB/s bus bandwidth at {max(sizes)} MiB" if speed is not None else ""
        warned = next((w for f in facts if (w := network.warning(f["network"], f.get("infiniband") or []))),
                      None)
        self.add("network", "WARN" if warned else "PASS",
                 warned or f"{network.describe(first['network'])}{measured}")

    @staticmethod
    def _gpu_check(mine: list[dict[str, Any]], c: ClusterConfig) -> tuple[str, str]:
        """(result, text) for the GPUs this node's ranks saw — saying what was measured."""
        want = c.gpus_per_node
        cuda = max(int(f.get("gpus_visible") or 0) for f in mine)
        slurm = mine[0].get("slurm_gpus_on_node")
        if want == 0:
            return "PASS", f"no GPUs requested; CUDA sees {cuda}"
        if c.device == "cpu":
            # CPU runs (the CI testbed): CUDA is not used, so only Slurm's allocation can be checked.
            ok = slurm is not None and int(slurm) == want
            return ("PASS" if ok else "FAIL",
                    f"Slurm allocated {slurm or 0} of {want} GPUs "
                    "(SLURM_GPUS_ON_NODE; device cpu, so no CUDA "
                    f"device was checked: torch sees {cuda})")
        ok = cuda == want
        names = sorted({str(f.get("device")) for f in mine})
        return ("PASS" if ok else "FAIL",
                f"CUDA sees {cuda} of {want} GPUs ({', '.join(names)}; Slurm allocated {slurm})"
                + ("" if ok else ": check the driver, gres.conf and CUDA_VISIBLE_DEVICES on this node"))


# ------------------------------------------------------------------------------------ helpers


_IMPORTS = r"""
import contextlib, importlib, importlib.metadata, io, json, sys
found = {}
for arg in sys.argv[1:]:
    name = arg.removeprefix("?")
    if arg.startswith("?"):  # not needed: its version from the package metadata, without importing it
        try:
            found[name] = {"version": importlib.metadata.version(name)}
        except importlib.metadata.PackageNotFoundError:
            found[name] = {"error": "not installed"}
        continue
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            module = importlib.import_module(name)
        found[name] = {"version": str(getattr(module, "__version__", "?"))}
        if name == "torch":
            found[name].update(cuda=module.version.cuda, gpus=module.cuda.device_count())
    except Exception as err:
        text = (str(err).strip().splitlines() or [""])[0]
        found[name] = {"error": f"{type(err).__name__}: {text}"}
print("PREFLIGHT " + json.dumps(found))
"""


def _import_versions(needed: list[str], optional: list[str]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Import each needed package in a fresh interpreter (the job's view, and their import noise stays
    there); of the optional ones only the installed version is read (importing deepspeed and diffusers
    would cost seconds of the command)."""
    try:
        out = subprocess.run([sys.executable, "-c", _IMPORTS, *needed, *(f"?{n}" for n in optional)],
                             capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {}, "importing the dependencies took over 300 s"
    for line in out.stdout.splitlines():
        if line.startswith("PREFLIGHT "):
            return json.loads(line[len("PREFLIGHT "):]), None
    return {}, (f"the import check crashed (exit {out.returncode}): "
                f"{_last_error_line(out.stderr) or 'no output'}")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^(\w+(Error|Exception)|error):?", ln)]
    return (errors or lines or [""])[-1][:400]
