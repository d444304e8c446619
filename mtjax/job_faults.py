"""One process's fault ends every process of a multi-process job, in one line each.

A process that fails (a checkpoint write, a data file, ...) would otherwise leave its peers waiting
for it inside a collective or one of orbax's barriers (5 minutes each), and itself wait at exit in
JAX's shutdown barrier for them. The command line (`mtjax.cli`) instead posts its one line in the
coordination service's key-value store and leaves at once (`end_job`); every other process watches
for that key in a thread (`watch_for_faults`), prints it as one line of its own and leaves with the
same status. Whichever thread of a process takes that on first (`_take_exit`) prints the one line.
Process 0 hosts the service, so it leaves last: after every peer has said it read the key (at most
_ACK_WAIT_S, a peer killed outright never says so), and _EXIT_GRACE_S more for the peers to exit.

It uses `jax._src.distributed.global_state.client` (private; in jax 0.10.2 and 0.11.2), and
module flags (`_watching`, `_ending`) that are per process by nature: the watcher is a thread of it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

_FAULT_KEY, _ACK_KEY = "mtjax/fault", "mtjax/fault-read/"
_ACK_WAIT_S, _EXIT_GRACE_S = 30.0, 1.0
_watching = False
_ending = []                        # the status this process leaves with, once one of its threads took that on
_ending_lock = threading.Lock()


def _client():
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.client


def watch_for_faults() -> None:
    """In a joined job of several processes: end this process, in one line, once another posts a fault."""
    global _watching
    import atexit
    import jax
    if _client() is None or jax.process_count() < 2 or _watching:
        return
    _watching = True
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(_client(), jax.process_index(), jax.process_count(), stop),
                               name="mtjax-fault-watch", daemon=True)
    watcher.start()
    # Ended before JAX's own exit handler (registered earlier, so run later) shuts the client down: a
    # thread inside the client's call at the interpreter's end would abort the process.
    atexit.register(lambda: (stop.set(), watcher.join(5)))


def _watch(client, me: int, count: int, stop) -> None:
    while not stop.is_set():
        try:
            posted = client.blocking_key_value_get(_FAULT_KEY, 1000)
            break
        except Exception as e:      # a second passed; else the service is gone: stop watching
            if "DEADLINE_EXCEEDED" not in str(e):
                return
    else:
        return
    status, sender, line = posted.split("|", 2)
    if int(sender) == me or not _take_exit(int(status)):
        return                      # this process's own fault: its main thread ends it
    say(f"error: process {sender} of this job failed, so this one stops: {line}")
    _leave(client, me, count, int(status))


def _take_exit(status: int) -> bool:        # whether this thread is the first to end its process
    with _ending_lock:
        if _ending:
            return False
        _ending.append(status)
        return True


def say(line: str) -> None:
    """`line` on stderr, unless stderr cannot take it: a log file on the disk that just filled up
    must not keep this process from telling its peers (`end_job`) and leaving."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def end_job(line: str, status: int) -> None:
    """Print this process's one-line `line`; in a job of several processes (status != 0), post it for
    the peers and leave at once. A process already ending on a peer's line (its watcher printed it:
    this one is likely the error its peer's leaving caused) leaves with that, quietly."""
    client = _client()
    if not _watching or client is None or status == 0:
        say(line)
        return
    import jax
    me = jax.process_index()
    if _take_exit(status):
        say(line)
        text = line[len("error: "):] if line.startswith("error: ") else line
        try:
            client.key_value_set(_FAULT_KEY, f"{status}|{me}|{text}")
        except Exception:           # another process posted first: this process's own line stands
            pass
    _leave(client, me, jax.process_count(), _ending[0])


def _quiet_stderr() -> None:
    """The one line is out: what the runtime's threads log while the job comes apart (gRPC's and the
    preemption notices' warnings once process 0's service is gone) goes nowhere."""
    with contextlib.suppress(OSError):
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def _leave(client, me: int, count: int, status: int) -> None:
    """Say this process read the fault, wait for the others' word if this is process 0, exit. (A peer
    exits right after its word, but a busy machine may hold it a moment, and JAX aborts one whose
    service is gone, with a stack trace: process 0 gives it _EXIT_GRACE_S.)"""
    import time
    with contextlib.suppress(OSError):
        sys.stdout.flush()          # (os._exit would drop it; may fail as `say` may)
    _quiet_stderr()
    with contextlib.suppress(Exception):
        client.key_value_set(f"{_ACK_KEY}{me}", "1")    # (fails if its other thread leaving said it)
    if me == 0:
        try:
            deadline = time.monotonic() + _ACK_WAIT_S
            for peer in range(1, count):
                client.blocking_key_value_get(f"{_ACK_KEY}{peer}", max(1, int(1000 * (deadline - time.monotonic()))))
            time.sleep(_EXIT_GRACE_S)
        except Exception:
            pass
    os._exit(status)
