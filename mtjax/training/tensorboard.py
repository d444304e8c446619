"""TensorBoard scalars written in the training thread: one event file under `<run_dir>/tb`.

tensorboardX's SummaryWriter writes from a thread of its own and flushes again at interpreter
exit; when its disk fills, both print tracebacks after the run's one error line. The event
file here is written by the caller only, one scalar event per metric, flushed with each logged
step (as `metrics.jsonl` is), so a failed write is an OSError in the loop and nothing else.

The file: a `file_version` event, then, where a run starts or resumes at step n, a SessionLog
START at n (TensorBoard hides the earlier files' events from step n on: those steps are redone
or belong to another run), then the scalars. Only tensorboardX's protocol buffers and its
record framing (`EventsWriter`, synchronous) are used.
"""
from __future__ import annotations

import os
import time


class ScalarEvents:
    """add_scalar(tag, value, step) in the calling thread; flush(); close()."""

    def __init__(self, logdir: str, purge_step: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        self._event, self._summary = Event, Summary
        os.makedirs(logdir, exist_ok=True)
        # tensorboardX names the file by the second and the host, and truncates a file of that
        # name: a run resumed within the second would erase its predecessor's events. The
        # number of event files already there makes the name new (they only accumulate).
        earlier = sum(".tfevents." in name for name in os.listdir(logdir))
        self._writer = EventsWriter(os.path.join(logdir, "events"), filename_suffix=f".{earlier}")
        self._writer.write_event(Event(wall_time=time.time(), step=purge_step,
                                       session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.write_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
