#!/usr/bin/env bash
# Re-executes notebooks/submit_and_monitor.ipynb on the Slurm testbed (through its test, which injects the
# parameters with papermill) and copies the executed notebook and the whole run's plot into the tree, so the
# committed outputs and docs/submit_and_monitor.png come from one run. The test itself writes nothing tracked.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp -d)"
TAEHV_NOTEBOOK_OUT="$out" python3 -m pytest -q tests/test_notebook.py
cp "$out/submit_and_monitor.ipynb" notebooks/submit_and_monitor.ipynb
cp "$out/notebook-plot-resumed.png" docs/submit_and_monitor.png
rm -rf "$out"
echo "updated notebooks/submit_and_monitor.ipynb and docs/submit_and_monitor.png"
