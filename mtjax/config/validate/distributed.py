"""The `distributed` group: how this process joins a multi-process job."""
from __future__ import annotations

from mtjax.config.schema import Config
from mtjax.config.validate.common import check


def validate_distributed(cfg: Config) -> None:
    """The `distributed` group; needs no devices, so it also runs before JAX starts (mtjax.distributed)."""
    dc = cfg.distributed
    check(dc.num_processes >= 0, "distributed.num_processes", f"must be >= 0, got {dc.num_processes}")
    check(dc.process_id >= -1, "distributed.process_id", f"must be >= -1, got {dc.process_id}")
    for name in ("join_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
        check(getattr(dc, name) >= 1, f"distributed.{name}", f"must be >= 1, got {getattr(dc, name)}")
    if dc.coordinator:
        host, _, port = dc.coordinator.rpartition(":")
        check(bool(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536, "distributed.coordinator",
              f"must be host:port, got {dc.coordinator!r}")
        check(dc.num_processes >= 1, "distributed.num_processes", "must be set (>= 1) with distributed.coordinator")
        check(dc.process_id >= 0, "distributed.process_id", "must be set (>= 0) with distributed.coordinator")
    if dc.num_processes and dc.process_id >= 0:
        check(dc.process_id < dc.num_processes, "distributed.process_id",
              f"must be < num_processes {dc.num_processes}, got {dc.process_id}")
