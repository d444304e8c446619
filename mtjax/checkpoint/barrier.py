"""The barrier orbax's background threads meet at, left by a process whose write failed.

In a job of several processes, each process's save thread waits at a barrier once its files are
written (and once process 0 has renamed the checkpoint), and its finalize thread at two more when it
marks the save finished, which it also does on its way out of a failed write (in a `finally`). A
process whose write failed (a full disk, a file-system error, after the save had started) would
wait there for peers that wait at the first barrier for its files: every process of the job until
`AsyncOptions.timeout_secs` (20 minutes).

So a background thread that is raising (its own process's save failed) goes past the barrier, and
the failure is kept for the main thread: the training loop asks every step (`Checkpointer.check`);
orbax itself would report it only at the next save or wait. The main thread ends the process in
one line and posts it for the others (`mtjax.job_faults.end_job`), whose fault watcher ends them
wherever they wait. Every other wait is orbax's own barrier.
"""
from __future__ import annotations

import sys
import threading

import orbax.checkpoint as ocp


class Barrier:
    """`AsyncOptions.barrier_sync_fn` of one checkpoint manager; `failed`: a save of its failed in
    the background (a background thread passed the barrier with the exception on its way out)."""

    def __init__(self):
        self.failed = False

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        if sys.exc_info()[1] is not None and threading.current_thread() is not threading.main_thread():
            self.failed = True
            return      # the peers will not come: they wait for this process's files
        ocp.multihost.get_barrier_sync_fn()(key=key, timeout_ms=timeout_ms)
