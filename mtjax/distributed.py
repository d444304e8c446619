"""Joining a multi-process JAX job: from explicit options, a detected cluster, or not at all.

Each process runs the same program on its own local devices; after
`jax.distributed.initialize` every process sees all global devices
(`jax.devices()`) and owns `jax.local_devices()`. The `distributed` config group
picks one of three modes:

- explicit: `coordinator` (host:port of process 0) is set, with `num_processes`
  and `process_id`; JAX's cluster detection is switched off.
- cluster: no coordinator, but this process is one of several tasks of a SLURM
  step (`srun`) or an Open MPI job (`mpirun`): `jax.distributed.initialize()`
  reads the coordinator, process count and id from the environment, as JAX's
  own detection does (set fields override what it reads).
- single: neither; one process, no initialization.

Initialization must come after the config is loaded (which does not touch JAX)
and before anything asks for devices, because the backend learns the process
count once, when it starts.

`initialize` joins: in explicit mode a process other than 0 first waits for the coordinator
in Python (`wait_for_coordinator`: Ctrl-C ends the wait, a wrong address is one line); once
joined, the processes compare their configs field by field (`check_same_config`, one
all-gather of CRC-32s, `config_digests`) and refuse one that differs.
"""
from __future__ import annotations

import os
from typing import Mapping

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config
from mtjax.config.validate import validate_distributed

EXPLICIT, CLUSTER, SINGLE = "explicit", "cluster", "single"

# The variables JAX's SlurmCluster and OmpiCluster need (jax/_src/clusters), and
# the one that says how many tasks there are: a job of one task stays single, so
# an interactive `salloc` shell or a one-task batch script does not wait for peers.
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI_VARS = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


def _tasks(environ: Mapping[str, str], names: tuple[str, ...], count: str) -> int:
    """The task count `environ[count]` when all of `names` are set; else 0."""
    if not all(n in environ for n in names):
        return 0
    try:
        return int(environ[count])
    except ValueError:
        return 0


def cluster_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """'slurm' or 'openmpi' when this process is one of several tasks JAX can bootstrap from; else None."""
    environ = os.environ if environ is None else environ
    if _tasks(environ, _SLURM_VARS, "SLURM_NTASKS") > 1:
        return "slurm"
    if _tasks(environ, _OMPI_VARS, "OMPI_COMM_WORLD_SIZE") > 1:
        return "openmpi"
    return None


def choose_mode(cfg: Config, environ: Mapping[str, str] | None = None) -> str:
    """EXPLICIT, CLUSTER or SINGLE for a validated config in this environment."""
    dc = cfg.distributed
    if dc.coordinator:
        return EXPLICIT
    kind = cluster_environment(environ)
    if kind:
        _check_cluster_ids(os.environ if environ is None else environ, kind)
        return CLUSTER
    if dc.num_processes > 1:
        raise ConfigError("distributed.coordinator",
                          f"must be set for num_processes={dc.num_processes} when no SLURM or Open MPI job is detected")
    return SINGLE


def _check_cluster_ids(environ: Mapping[str, str], kind: str) -> None:
    """The rank variables JAX will read must be integers (a bad one is a traceback inside JAX)."""
    slurm, openmpi = ("SLURM_PROCID", "SLURM_LOCALID"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    names = slurm if kind == "slurm" else openmpi
    for name in names:
        value = environ.get(name)
        if value is not None and not (value.isascii() and value.isdigit()):
            raise ConfigError(name, f"must be a non-negative integer, got {value!r} (environment of this {kind} task)")


def _enable_cpu_collectives() -> None:
    """Cross-process collectives on CPU need an implementation; JAX 0.10 defaults to gloo, older ones to none."""
    import jax
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(cfg: Config, environ: Mapping[str, str] | None = None) -> str:
    """Join the job `cfg.distributed` describes, before the JAX backend starts; returns the mode."""
    import jax
    validate_distributed(cfg)
    mode = choose_mode(cfg, environ)
    if mode == SINGLE:
        return mode
    _enable_cpu_collectives()
    dc = cfg.distributed
    timeouts = dict(initialization_timeout=dc.join_timeout_s, heartbeat_timeout_seconds=dc.heartbeat_timeout_s,
                    shutdown_timeout_seconds=dc.shutdown_timeout_s)
    if mode == EXPLICIT:
        if dc.process_id != 0:
            wait_for_coordinator(dc.coordinator, dc.join_timeout_s)
        else:
            check_port_free(dc.coordinator)
        # detection off: otherwise JAX would still read SLURM_LOCALID and hide all GPUs but one
        jax.distributed.initialize(dc.coordinator, dc.num_processes, dc.process_id,
                                   cluster_detection_method="deactivate", **timeouts)
    else:
        jax.distributed.initialize(num_processes=dc.num_processes or None,
                                   process_id=dc.process_id if dc.process_id >= 0 else None, **timeouts)
    check_same_config(cfg)
    return mode


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Until process 0 listens at `address` (host:port), for at most `timeout_s`; then one line.
    JAX's own join waits inside C++ (no signal handled meanwhile) and ends in an abort with a
    stack trace; this wait is Python's, so Ctrl-C ends it, and a wrong address is one line."""
    import socket
    import time
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError("distributed.coordinator",
                                  f"{address} did not answer within distributed.join_timeout_s={timeout_s:g} s "
                                  f"({e.strerror or e}): is process 0 started, and is this its address?") from None
        time.sleep(0.5)


def check_port_free(address: str) -> None:
    """Process 0 binds the coordinator's port on every interface, as JAX's service will: a port
    already taken (a second process given process_id=0, another program) is one line here; in JAX,
    every process of the job would end in a C++ abort."""
    import socket
    port = int(address.rpartition(":")[2])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))
    except OSError as e:
        raise ConfigError("distributed.process_id", f"0 is this process, but port {port} of "
                          f"distributed.coordinator={address} is already in use on this host ({e.strerror or e}): "
                          f"is another process given process_id=0?") from None


def config_digests(cfg: Config) -> list[tuple[str, int]]:
    """(group.field, CRC-32 of its value) of every field a process's config must share with the
    others': all but `distributed.process_id`, in a fixed order."""
    import json
    import zlib
    rows = []
    for group, fields in sorted(cfg.to_dict().items()):
        for name, value in sorted(fields.items()):
            if (group, name) != ("distributed", "process_id"):
                text = json.dumps(value, sort_keys=True, default=str)
                rows.append((f"{group}.{name}", zlib.crc32(text.encode())))
    return rows


def check_same_config(cfg: Config) -> None:
    """Every process must run the same config: one given another seed would train other weights
    in silence, one given other sizes would fail inside a collective, one given more steps would
    wait for its peers forever. The processes exchange a digest per field (one small all-gather,
    the job's first collective) and each refuses the first field that differs, in one line."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    rows = config_digests(cfg)
    mine = np.array([d for _, d in rows], dtype=np.uint32).view(np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), len(rows))
    for k, (key, _) in enumerate(rows):
        others = [int(i) for i in np.nonzero(every[:, k] != every[0, k])[0]]
        if others:
            raise ConfigError(key, f"differs between the processes of this job (process 0's is not process "
                                   f"{', '.join(map(str, others))}'s): give every process the same config")
