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

pids=()
for ((i = 0; i < n; i++)); do
    dist=(distributed.coordinator=localhost:$port distributed.num_processes=$n distributed.process_id=$i)
    if [ "$i" -eq 0 ]; then
        "$python" -m mtjax.train "$@" "${dist[@]}" &
    else
        "$python" -m mtjax.train "$@" "${dist[@]}" >"$log_dir/process-$i.log" 2>&1 &
    fi
    pids+=($!)
done

stop_all() {
    # TERM first; JAX's preemption service catches TERM and keeps running, so KILL what is left
    kill -TERM "${pids[@]}" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        [ -z "$(jobs -rp)" ] && return 0
        sleep 0.5
    done
    kill -KILL "${pids[@]}" 2>/dev/null
}
trap 'stop_all; exit 130' INT TERM

# Wait for whichever process ends next; the first failure stops the rest (they
# would otherwise wait for their peer until JAX's timeouts run out).
status=0
for ((k = 0; k < n; k++)); do
    wait -n
    rc=$?
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
        status=$rc
        echo "launch_local: a process exited with status $rc; stopping the others (logs in $log_dir)" >&2
        stop_all
    fi
done
exit "$status"
