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

import contextlib
import os
import sys
import threading
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


# -- one process's fault ends every process
#
# A process that fails (a checkpoint write, a data file, ...) would otherwise leave its peers waiting
# for it inside a collective or one of orbax's barriers (5 minutes each), and itself wait at exit in
# JAX's shutdown barrier for them. The command line (`mtjax.cli`) instead posts its one line in the
# coordination service's key-value store and leaves at once; every other process watches for that
# key in a thread (`watch_for_faults`), prints it as one line of its own and leaves with the same
# status. Whichever thread of a process takes that on first (`_take_exit`) prints the one line.
# Process 0 hosts the service, so it leaves last: after every peer has said it read the key (at most
# _ACK_WAIT_S, a peer killed outright never says so), and _EXIT_GRACE_S more for the peers to exit.

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
