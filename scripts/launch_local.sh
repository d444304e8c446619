#!/usr/bin/env bash
# Run N processes of `python -m mtjax.train` on this machine as one multi-process JAX job.
#
#   scripts/launch_local.sh N [train args...]
#   scripts/launch_local.sh 2 --config configs/tiny.yaml --cpu-devices 4 parallel.tensor=2
#
# Process i gets distributed.coordinator=localhost:PORT (a free port),
# distributed.num_processes=N and distributed.process_id=i after the given args.
# With --cpu-devices D each process has D CPU devices: N*D global devices.
# Process 0 writes to this terminal; process i>0 to $MTJAX_LOG_DIR/process-i.log
# (default: a new directory under /tmp, printed at the start).
# Exit status: 0 when all succeed; else the first failure's, after stopping the others.
# Ctrl-C or SIGTERM: passed on once to every process (each saves and stops, as one process does).
set -u

if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 N [python -m mtjax.train args...]" >&2
    exit 2
fi
n=$1
shift
python=${PYTHON:-python}
log_dir=${MTJAX_LOG_DIR:-$(mktemp -d /tmp/mtjax-launch.XXXXXX)}
mkdir -p "$log_dir"
# A port free now; the coordinator (process 0) binds it a moment later.
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
echo "launch_local: $n processes, coordinator localhost:$port, logs of processes 1..$((n - 1)) in $log_dir" >&2

# Each process in a session of its own: a terminal's Ctrl-C (or `timeout`'s signal to the group)
# reaches the launcher only, which passes it on once. A process given the signal twice (the
# terminal's, then the launcher's) would take it as the second and stop at once, unsaved.
pids=()
for ((i = 0; i < n; i++)); do
    dist=(distributed.coordinator=localhost:$port distributed.num_processes=$n distributed.process_id=$i)
    if [ "$i" -eq 0 ]; then
        setsid "$python" -m mtjax.train "$@" "${dist[@]}" &
    else
        setsid "$python" -m mtjax.train "$@" "${dist[@]}" >"$log_dir/process-$i.log" 2>&1 &
    fi
    pids+=($!)
done

# After a signal: each process stops as its first signal says (finishes the step, saves), within
# MTJAX_STOP_WAIT_S (default 180 s: a save's bound is 60 s); what is left then is killed.
# A second signal is passed on too (each process then stops at once).
stop_wait=${MTJAX_STOP_WAIT_S:-180}
watchdog=""
forward() {
    kill -"$1" "${pids[@]}" 2>/dev/null
    if [ -z "$watchdog" ]; then
        # (its output away from ours: a reader waiting for our end of file must not wait for it)
        (trap 'kill "$nap" 2>/dev/null; exit 0' TERM
         sleep "$stop_wait" & nap=$!
         wait "$nap" && kill -KILL "${pids[@]}" 2>/dev/null) >/dev/null 2>&1 &
        watchdog=$!
    fi
}
trap 'forward INT' INT
trap 'forward TERM' TERM

# After one process fails: the others wait for their peer inside a collective and cannot stop
# cleanly; TERM, then KILL what is left 5 s later.
stop_all() {
    kill -TERM "${pids[@]}" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 0 ] && return 0
        sleep 0.5
    done
    kill -KILL "${pids[@]}" 2>/dev/null
}

# Wait for whichever process ends next; the first failure stops the rest. The exit status is the
# first failure's, else process 0's (0, or 128 + the signal's number where it stopped unsaved).
status=0
status0=0
live=("${pids[@]}")
while [ "${#live[@]}" -gt 0 ]; do
    ended=""
    wait -n -p ended "${live[@]}"
    rc=$?
    ended=${ended:-}                      # (unset by an interrupted wait)
    if [ -z "$ended" ]; then
        # A trapped signal interrupted the wait, or bash had already reaped the one that ended
        # (`wait -n` then knows no such job; plain `wait PID` still returns its status).
        for pid in "${live[@]}"; do
            if ! kill -0 "$pid" 2>/dev/null; then
                wait "$pid"
                rc=$?
                ended=$pid
                break
            fi
        done
        [ -z "$ended" ] && { sleep 0.2; continue; }
    fi
    rest=()
    for pid in "${live[@]}"; do [ "$pid" != "$ended" ] && rest+=("$pid"); done
    live=("${rest[@]}")
    [ "$ended" = "${pids[0]}" ] && status0=$rc
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
        status=$rc
        if [ -z "$watchdog" ]; then
            echo "launch_local: a process exited with status $rc; stopping the others (logs in $log_dir)" >&2
            stop_all
        fi
    fi
done
[ -n "$watchdog" ] && kill "$watchdog" 2>/dev/null
[ "$status" -eq 0 ] && status=$status0
exit "$status"
