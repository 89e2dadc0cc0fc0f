#!/usr/bin/env bash
# Writes results/cluster-sweep/after-cancel.txt and after-resume.txt: the --status tables that
# chapter 5 and the README show, from a real sweep on the one-node cluster of this folder.
# A small sweep of chapter 4 (one bit width, two methods, 64 tokens) is submitted; once both
# runs are running, one job is cancelled with scancel; the table is saved; --resume submits
# that run again; the table is saved again. Run from the checkout, with a clean tree (chapter 5
# plots only runs made at the current code); it takes a few minutes:
#   bash cluster/status-example.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
bash cluster/start.sh
export SLURM_CONF="${RQLIB_SLURM_DIR:-/tmp/rqlib-slurm}/slurm.conf"
sweeps=sweeps/cluster-example
out=results/cluster-sweep
rm -rf "$sweeps"
mkdir -p "$out"
sweep=("$python" -m rqlib sweep notebooks/04_perplexity.ipynb -f params/04_perplexity-sweep.yaml
    -p key_bits 2 -p method turboquant-mse turboquant-prod -p tokens 64 -p window 64
    --results-dir "$sweeps" --executor slurm --time-limit 10)
"${sweep[@]}" --detach
records="$sweeps/runs/04_perplexity"
state() { "$python" -c "import json,sys; print(json.load(open(sys.argv[1]))['state'])" "$1"; }
for _ in $(seq 600); do  # both runs running (each has recorded it)
    running=0
    for record in "$records"/*.json; do [ "$(state "$record")" = running ] && running=$((running + 1)); done
    [ "$running" = 2 ] && break
    sleep 0.5
done
cancelled="$(ls "$records"/*turboquant-prod*.json)"
job="$("$python" -c "import json,sys; print(json.load(open(sys.argv[1]))['job_id'])" "$cancelled")"
scancel "$job"
for _ in $(seq 600); do  # the cancelled run failed and the other one done
    "$python" -m rqlib sweep --status "$sweeps" | tail -n 1 | grep -q "1 done, 1 failed" && break
    sleep 1
done
"$python" -m rqlib sweep --status "$sweeps" --save-status "$out/after-cancel.txt" --force
"${sweep[@]}" --resume
"$python" -m rqlib sweep --status "$sweeps" --save-status "$out/after-resume.txt" --force
