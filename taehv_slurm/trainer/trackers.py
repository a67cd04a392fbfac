"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow, written by rank 0.

One tracker run per training run, across every requeue and resubmit: the first attempt creates it and
writes its id to the run folder (`RunFolder.trackers`); every later attempt (a requeue, a resubmit under
the same `--name`) reopens that run and goes on logging at the step it resumed from. A run folder is the
identity of a training run here, so it is also the tracker run's. Turned on in the train YAML
(`tracking:`), the packages from the `trackers` extra.

W&B resumes with `id=<kept id>, resume="allow"`: online the steps continue in one run; offline each
attempt writes an `offline-run-*-<id>` folder under `<run>/wandb/`. W&B logs through a service process of
its own, which Slurm's SIGTERM at a preemption ends with the job's other processes, and the lines it had
not sent are lost (on the testbed a preempted attempt's offline file stays empty). So every attempt
first logs again what the run's metrics kept from before it (`Trackers.replay`): the run's W&B history is
whole once an attempt finishes. A tracker that fails, as it starts or later, is dropped for the attempt
with one warning; it never stops training or its save.

MLflow logs to `tracking.mlflow_tracking_uri` (or $MLFLOW_TRACKING_URI), else to a file store in
`<run>/mlruns` (`mlflow ui --backend-store-uri <run>/mlruns`); the run is marked FINISHED when training
completes, and stays RUNNING across requeues.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from taehv_slurm.common.changes import flatten
from taehv_slurm.common.config import TrackingConfig
from taehv_slurm.common.runfolder import METRICS, RunFolder, write_text_atomic

log = logging.getLogger("taehv")


class Trackers:
    """The tracker runs of one training run (none when the config turns none on)."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        self.path = RunFolder(run_dir).trackers
        ids = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.wandb = self.mlflow = None
        # A tracker that cannot start (its server unreachable, its package missing) is dropped like one
        # that fails later: training goes on without it.
        if cfg.wandb:
            self._guarded("wandb", lambda: self._start_wandb(cfg, Path(run_dir), name, config, ids))
        if cfg.mlflow:
            self._guarded("mlflow", lambda: self._start_mlflow(cfg, Path(run_dir), name, config, ids))
        if ids:
            write_text_atomic(self.path, json.dumps(ids, indent=1) + "\n", 0o600)

    def _start_wandb(self, cfg: TrackingConfig, run_dir: Path, name: str, config: Mapping[str, Any],
                     ids: dict[str, Any]) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")  # the rank log stays ours
        ids.setdefault("wandb", uuid.uuid4().hex[:8])  # W&B's own ids look the same
        self.wandb = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, id=ids["wandb"],
                                resume="allow", name=name, dir=str(run_dir), mode=cfg.wandb_mode,
                                config=dict(config))

    def _start_mlflow(self, cfg: TrackingConfig, run_dir: Path, name: str, config: Mapping[str, Any],
                      ids: dict[str, Any]) -> None:
        self.mlflow = _MlflowRun(cfg, run_dir, name, config, ids.get("mlflow"))
        ids["mlflow"] = self.mlflow.run_id
        ids["mlflow_tracking_uri"] = self.mlflow.uri

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """`values` by tag ("train/loss", "val/psnr", "lr", ...), at optimizer step `step`."""
        if self.wandb is not None:
            self._guarded("wandb", lambda: self.wandb.log(dict(values), step=step))
        if self.mlflow is not None:
            self._guarded("mlflow", lambda: self.mlflow.log(step, values))

    @property
    def wants_replay(self) -> bool:
        """Whether `replay` does anything: W&B is on (MLflow keeps every line as it is logged)."""
        return self.wandb is not None

    def replay(self, lines: list[tuple[int, Mapping[str, float]]]) -> None:
        """The run's metrics lines from before this attempt (the run's metrics keep each once), again to W&B:
        its service process dies with a preempted attempt, and the lines it had not sent die with it;
        no later attempt can tell which. Online, lines below the resumed run's step (what the server
        has) are skipped; offline, each attempt's folder holds the whole history from step 1, so the
        newest folder alone is the run (`wandb sync` it). MLflow writes each line as it is logged."""
        if not self.wants_replay:
            return
        resumed_at = self.wandb.step  # online: the server's next step of this run; offline: 0

        def log_all() -> None:
            for step, values in lines:
                if step >= resumed_at:
                    self.wandb.log(dict(values), step=step)

        self._guarded("wandb", log_all)

    def log_image(self, step: int, tag: str, image: Any) -> None:
        """An H×W×3 uint8 image (numpy) at optimizer step `step`."""
        if self.wandb is not None:
            import wandb

            self._guarded("wandb", lambda: self.wandb.log({tag: wandb.Image(image)}, step=step))
        if self.mlflow is not None:
            self._guarded("mlflow", lambda: self.mlflow.client.log_image(self.mlflow.run_id, image, key=tag,
                                                                          step=step))

    def close(self, finished: bool) -> None:
        """End this attempt's logging; `finished`: the training run is complete (not a requeue)."""
        if self.wandb is not None:
            self._guarded("wandb", lambda: self.wandb.finish(exit_code=0))
            self.wandb = None
        if self.mlflow is not None:
            self._guarded("mlflow", lambda: self.mlflow.close(finished))
            self.mlflow = None

    def _guarded(self, name: str, call: Callable[[], Any]) -> None:
        """A tracker that fails (its server gone, a full disk) never stops training or its save: it is
        dropped for the rest of this attempt, with one warning; the run's metrics and TensorBoard go on."""
        try:
            call()
        except Exception as err:  # noqa: BLE001 - any failure of a third-party logger
            log.warning("%s tracking stopped for this attempt: %s: %s (%s and TensorBoard go on)",
                        name, type(err).__name__, err, METRICS)
            setattr(self, name, None)


class _MlflowRun:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, name: str, config: Mapping[str, Any],
                 run_id: str | None) -> None:
        import mlflow
        from mlflow.entities import Param

        self.uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not self.uri:
            # MLflow 3 keeps its file store only on request; it is the store that needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.uri = (run_dir / "mlruns").absolute().as_uri()
        self.client = mlflow.MlflowClient(self.uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(cfg.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(cfg.mlflow_experiment))
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow's limit per batch
                self.client.log_batch(run_id, params=params[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run_id, status="FINISHED")

