#!/usr/bin/env bash
# Stop the one-node cluster cluster/start.sh started: each daemon by the pid it wrote.
set -uo pipefail
state="${RQLIB_SLURM_DIR:-/tmp/rqlib-slurm}"
for pidfile in "$state/slurmd.pid" "$state/slurmctld.pid" "$state/munge/munged.pid"; do
    if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        pid="$(cat "$pidfile")"
        kill "$pid"
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        echo "stopped $(basename "$pidfile" .pid) ($pid)"
    fi
done
