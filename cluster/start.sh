#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (munged, slurmctld, slurmd), from
# cluster/slurm.conf, with every state, spool, pid and log file under $RQLIB_SLURM_DIR
# (default /tmp/rqlib-slurm). Idempotent: daemons already answering are left as they are.
# Clients then need SLURM_CONF=$RQLIB_SLURM_DIR/slurm.conf (printed at the end).
# A daemon that does not start fails this script with its own log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
state="${RQLIB_SLURM_DIR:-/tmp/rqlib-slurm}"
conf="$state/slurm.conf"
export SLURM_CONF="$conf"
mkdir -p "$state/ctld" "$state/spool" "$state/log" "$state/munge"

for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || { echo "cluster/start.sh: $tool not found: apt-get install slurm-wlm munge" >&2; exit 1; }
done

fail() {  # fail WHAT LOG: say what did not start, with the end of its log
    echo "cluster/start.sh: $1 did not start; the end of $2:" >&2
    tail -n 30 "$2" >&2 2>/dev/null || echo "(no log written)" >&2
    exit 1
}

# munge: the key (created once), then the daemon, unless one already answers
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else create-munge-key -f; fi
fi
socket="$state/munge/munge.socket"
if ! munge -n --socket="$socket" 2>/dev/null | unmunge --socket="$socket" >/dev/null 2>&1; then
    chown root:root /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
    munged --force --socket="$socket" --pid-file="$state/munge/munged.pid" \
        --log-file="$state/log/munged.log" --seed-file="$state/munge/munged.seed" \
        || fail munged "$state/log/munged.log"
fi

# the configuration: this machine's node line and the state folder
host="$(hostname -s)"
node="$(slurmd -C | head -n 1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")"
sed -e "s|@NODE@|$node|" -e "s|@HOST@|$host|g" -e "s|@STATE@|$state|g" \
    "$here/slurm.conf" > "$conf.tmp"
echo "AuthInfo=socket=$socket" >> "$conf.tmp"
mv "$conf.tmp" "$conf"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
alive "$state/slurmctld.pid" || slurmctld -f "$conf" || fail slurmctld "$state/log/slurmctld.log"
alive "$state/slurmd.pid" || slurmd -f "$conf" || fail slurmd "$state/log/slurmd.log"

# ready when the node takes jobs
for _ in $(seq 60); do
    node_state="$(sinfo --noheader --nodes="$host" --format=%T 2>/dev/null || true)"
    case "$node_state" in
        idle*|mixed*|allocated*) echo "Slurm is up on $host; export SLURM_CONF=$conf"; exit 0 ;;
        drain*|down*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
done
alive "$state/slurmctld.pid" || fail slurmctld "$state/log/slurmctld.log"
fail "slurmd (node $host is '${node_state:-unknown}')" "$state/log/slurmd.log"
