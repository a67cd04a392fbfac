"""The benchmarks' --smoke modes (CPU, tiny sizes): they must keep running, so the GPU runs never rot.

One test function per benchmark script, and one for bench/results/: every file there is in its index and
backs a figure in docs/benchmarks.md, and every result file those name exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from taehv_slurm.trainer.hunyuan_encoder import ENCODER_PREFIXES
from taehv_slurm.trainer.layers import FAST_PATHS
from tests.helpers import REPO


def run_smoke(script: str, out: Path, timeout: int = 300,
              *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    run = subprocess.run([sys.executable, f"bench/{script}", "--smoke", "--out", str(out), *argv],
                         capture_output=True, text=True, cwd=REPO, timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"wrote {out}" in run.stdout
    result = json.loads(out.read_text())
    info = result.get("info", result)
    assert info["torch"] and info["date"] and info["device"]  # every figure names where it was measured
    return run, result


def published_encoder_parameters() -> int:
    from diffusers import AutoencoderKLHunyuanVideo

    with torch.device("meta"):
        vae = AutoencoderKLHunyuanVideo()
    return sum(p.numel() for name, p in vae.named_parameters() if name.startswith(ENCODER_PREFIXES))


def test_prepare_throughput_smoke(tmp_path: Path) -> None:
    run, result = run_smoke("prepare_throughput.py", tmp_path / "prepare.json")
    # the GPU mode's teacher: diffusers' default HunyuanVideo VAE less its decoder
    assert result["info"]["default_encoder_parameters"] == published_encoder_parameters()
    sections = {row["section"]: row for row in result["rows"]}
    assert set(sections) == {"teacher", "decode", "read"}
    assert all("error" not in row for row in result["rows"]), result["rows"]
    teacher = [row for row in result["rows"] if row["section"] == "teacher"]
    assert [row["batch"] for row in teacher] == [1, 2] and all(row["clips_per_s"] > 0 for row in teacher)
    # 1 + 4k frames of a 4L window
    assert teacher[0]["teacher_frames"] == 5 and teacher[0]["window_frames"] == 8
    assert sections["decode"]["clips_per_s"] > 0 and sections["read"]["clips_per_s"] > 0
    assert "clips per CPU-second" in run.stdout


def test_train_throughput_smoke(tmp_path: Path) -> None:
    _, result = run_smoke("train_throughput.py", tmp_path / "train.json")
    assert result["info"]["train_tflop_per_clip"] > 0
    assert [(row["variant"], row["engine"]) for row in result["rows"]] == [("eager", "allreduce")]
    assert all(row["clips_per_s_per_gpu"] > 0 for row in result["rows"])


def test_rgb_head_throughput_smoke(tmp_path: Path) -> None:
    _, result = run_smoke("rgb_head_throughput.py", tmp_path / "head.json")
    # the head's input as the model's training pass builds it: 2 new frames × 64 channels × 2×2 phases
    assert result["info"]["stacked_shape"] == [2, 512, 16, 16] and result["info"]["frames_per_image"] == 2
    assert [row["path"] for row in result["rows"]] == ["plain_eager"]
    assert all(row["forward_ms"] > 0 and row["forward_backward_ms"] > 0 for row in result["rows"])


def test_relu_grad_throughput_smoke(tmp_path: Path) -> None:
    _, result = run_smoke("relu_grad_throughput.py", tmp_path / "relu_grad.json")
    # one row per shape the training pass runs a fused conv on, 56 calls a step as on the GPU
    assert result["info"]["fused_conv_calls_per_step"] == 56
    assert sum(row["calls_per_step"] for row in result["rows"]) == 56
    assert all(row["path"] == "eager" and row["us"] > 0 and row["bias_grad_rel_err"] < 1e-6
               for row in result["rows"])


def test_loader_throughput_smoke(tmp_path: Path) -> None:
    _, result = run_smoke("loader_throughput.py", tmp_path / "loader.json")
    for source in ("video", "prepared", "synthetic"):  # shards written by jobs.prepare from real H.264 files
        assert [row["workers"] for row in result["rows"] if row["source"] == source] == [0, 1]
    assert all(row["clips_per_s"] > 0 for row in result["rows"])


def test_end_to_end_throughput_smoke(tmp_path: Path) -> None:
    # Videos → jobs.prepare with a HunyuanVideo-architecture teacher → jobs.submit --local for each
    # source, beside the isolated step: the path whose GPU figures docs/benchmarks.md leads with. A further
    # override (--set) reaches every run: 4 micro-batches of 2, where the shipped per-GPU batch of 4 gives 2
    # of 4 (--smoke's effective batch of 8 on one rank).
    run, result = run_smoke("e2e_throughput.py", tmp_path / "e2e.json", 600, "--set", "batch.per_gpu=2")
    assert [row["source"] for row in result["rows"]] == ["prepared", "video", "synthetic"]
    for row in result["rows"]:
        assert row["exit"] == 0 and row["clips_per_s"] > 0 and row["isolated_clips_per_s"] > 0
        assert (row["grad_accum"], row["per_gpu_batch"]) == (4, 2)
        assert 0 <= row["data_wait"] <= 1 and row["steps_measured"] >= 1
    assert "e2e clips/s" in run.stdout


def test_suite_cpu_gives_each_test_the_cpu_of_the_processes_started_under_it(tmp_path: Path) -> None:
    # A process counts for the test it started under (pytest's PYTEST_CURRENT_TEST in its environment, which
    # a test's subprocesses and their Slurm ranks inherit): the command for this test, its child for another.
    # The grandchild burns 1.5 CPU seconds by its own clock, whatever the machine's speed; polling every 0.3 s
    # loses under 0.3 s of it.
    burn = "import time\nwhile time.process_time() < 1.5: pass"
    child = (f"import os, subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}], "
             "env={**os.environ, 'PYTEST_CURRENT_TEST': 'tests/test_x.py::test_y (call)'})")
    out = tmp_path / "cpu.json"
    run = subprocess.run([sys.executable, "bench/suite_cpu.py", "--out", str(out), "--", sys.executable, "-c",
                          child], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0 and f"wrote {out}" in run.stdout, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["by_test"]["tests/test_x.py::test_y"] >= 1.2
    assert result["by_module"]["tests/test_x.py"] >= 1.2
    assert os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0] in result["by_test"]


def test_fast_paths_quality_smoke(tmp_path: Path) -> None:
    # The shipped config through jobs.submit --local three times (as shipped twice, every fast path off
    # once), each run exported and its file's PSNR measured: the GPU run behind "the fast paths keep the
    # loss" in docs/benchmarks.md.
    _, result = run_smoke("fast_paths_quality.py", tmp_path / "quality.json", 600, "--work",
                          str(tmp_path / "work"))
    runs = [(r["label"], r["exit"]) for r in result["runs"]]
    assert runs == [("shipped", 0), ("shipped", 0), ("reference", 0)]
    assert result["runs"][2]["fast_paths_off"].split(",") == list(FAST_PATHS)
    for run in result["runs"]:
        assert [r["step"] for r in run["train"]] == [1, 2, 3, 4] and run["val"][-1]["step"] == 4
        assert 5 < run["exported_psnr"] < 60  # a real reconstruction's PSNR, not a missing or NaN one
    assert set(result["summary"]["reference_vs_shipped"]) == {"loss", "reconstruction_loss", "latent_loss",
                                                                "psnr"}


def test_requeue_signal_smoke(tmp_path: Path) -> None:
    # Two CPU ranks train, get SIGTERM at step 15, save and exit; the run resumes on one rank.
    _, result = run_smoke("requeue_signal.py", tmp_path / "signal.json", timeout=600)
    for mode in ("sync", "async"):
        assert result[mode]["exit_codes"] == [0, 0], result[mode]
        assert result[mode]["saved_step"] >= 15
    resume = result["resume"]
    assert resume["exit_codes"] == [0] and resume["from_step"] == result["sync"]["saved_step"]
    assert resume["final_step"] == resume["from_step"] + 3
    # effective batch held on half the ranks
    assert resume["grad_accum"] == 2 and resume["effective_batch"] == 4


def test_slow_rank_faults_smoke(tmp_path: Path) -> None:
    # 2 CPU ranks, the last one's process stopped 0.4 s of every 0.6 s from outside until the run names it
    # (120 s at most): named host. 16-step log windows (0.8 s on an idle 2-core machine, up to 4 s beside the
    # rest of the suite, twice that slowed) each hold a stopped spell: with 2-step windows those between the
    # spells were on time, and no 3 late ones came in a row on an idle machine. A fixed 30 s held too few
    # windows beside the suite on a slower machine.
    _, result = run_smoke("slow_rank_faults.py", tmp_path / "faults.json", 600, "--faults", "host",
                          "--log-every", "16", "--fault-step", "48", "--fault-s", "120", "--until-named",
                          "--work", str(tmp_path / "work"))
    (row,) = result["rows"]
    assert (row["fault"], row["named_rank"], row["named_cause"]) == ("host", 1, "host"), row
    assert row["fault_lasted_s"] < 120, row  # it ended when named
    assert row["lost_s_per_step"] > 0 and row["clips_per_s_during"] < row["clips_per_s_before"], row


def test_cli_latency_smoke(tmp_path: Path) -> None:
    # A finished smoke job, then each command that only looks, timed against `python -c pass`; the dry run
    # with and without its data check, Slurm or not (this test does not start the testbed).
    _, result = run_smoke("cli_latency.py", tmp_path / "cli.json")
    commands = [row["command"] for row in result["rows"]]
    assert commands[0] == "python -c pass" and result["rows"][0]["ratio"] == 1
    assert {"taehv status", "taehv status --all", "taehv logs JOB", "taehv cancel JOB"} <= set(commands)
    assert {"taehv submit --nodes 8 --dry-run", "taehv submit --nodes 8 --dry-run, data checked (missing)"} \
        <= set(commands)
    assert all(row["median_s"] > 0 and not row["imports_torch"] for row in result["rows"])


def test_status_scale_smoke(tmp_path: Path) -> None:
    # A real 2-step tiny run copied into job_dirs of 20 and 50 runs, the newest with a 2,000-line metrics
    # file; each status command timed in a fresh process, with its peak memory.
    _, result = run_smoke("status_scale.py", tmp_path / "status.json")
    commands = {"taehv status", "taehv status RUN", "taehv status --all"}
    assert {(r["runs"], r["command"]) for r in result["rows"]} == {(n, c) for n in (20, 50) for c in commands}
    assert all(r["median_s"] > 0 and 10 < r["max_rss_mb"] < 500 for r in result["rows"]), result["rows"]
    assert result["metrics_frame"]["rows"] == 2000 and result["metrics_frame"]["seconds"] > 0
    sizes = result["sizes"]  # as built: a registry line is a run's record, a metrics line a step's
    assert 1000 < sizes["registry_line_bytes"] < 10000 and 100 < sizes["metrics_line_bytes"] < 2000, sizes


def test_profile_analysis_prints_its_result_file() -> None:
    # Read from the kept trace and result files on CPU: the file docs/benchmarks.md cites is what the script
    # prints now (its first line names the commit it ran at).
    run = subprocess.run([sys.executable, "bench/profile_analysis.py"], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    kept = (REPO / "bench/results/profile_analysis_h200_2026-11-27_d93ee1d.txt").read_text()
    assert run.stdout.splitlines()[1:] == kept.splitlines()[1:]
    assert "cuDNN's convolutions: " in run.stdout and "FLOPs of one 13×480×720 clip: " in run.stdout


def test_slurm_scaling_smoke(slurm_cluster, tmp_path: Path) -> None:
    # On the CPU testbed: the data prepared through `taehv prepare` on 2 nodes, then one training run over
    # them, with its steady clips/s and the NCCL variables read from its ranks' processes (none on CPU).
    out = tmp_path / "scaling.json"
    argv = ["bench/slurm_scaling.py", "--smoke", "--shapes", "2x1", "--work", str(tmp_path / "work"),
            "--out", str(out)]
    run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["prepare"]["shape"] == "2x1" and result["prepare"]["prepare_shards"] >= 1
    (row,) = result["shapes"]
    assert row["exit"] == 0 and row["clips_per_s_per_gpu"] > 0 and row["steps_measured"] >= 1
    # one rank on each of two nodes, as each rank recorded it (the /proc watcher may miss a short run's rank)
    assert sorted(row["rank_hosts"]) == ["0", "1"] and len(set(row["rank_hosts"].values())) == 2, row


def test_goodput_model_recommends_shorter_intervals_at_scale(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "goodput_model.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [64, 512, 4096]
    intervals = [r["checkpoint_interval_min"] for r in rows]
    assert intervals == sorted(intervals, reverse=True)  # more GPUs, more failures: save more often
    assert all(r["ettr"] >= r["ettr_hourly_checkpoints"] for r in rows)  # the optimum beats hourly saves
    # a queue wait makes a requeue dear where faults are frequent: restarting inside the allocation wins at
    # 4096 GPUs even with a spare node held idle, and loses at 64, where the spare costs more than faults do
    assert rows[-1]["ettr_restart_in_allocation"] > rows[-1]["ettr"] > rows[-1]["ettr_hourly_checkpoints"]
    assert rows[0]["ettr_restart_in_allocation"] < rows[0]["ettr"] <= rows[0]["ettr_idle_queue"]
