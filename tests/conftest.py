"""Every test runs on 8 simulated CPU devices, in fp32, with rank promotion as an error."""
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

# XLA:CPU's code generation, made cheaper (the HLO passes, and so the collectives and memory the
# tests read, are unchanged):
# - its loop and elementwise fusions through the older LLVM IR emitters rather than the MLIR fusion
#   emitters: a tiny trainer's compile takes about 35% less CPU time (12 s rather than 19 s for a
#   (2, 2, 2) Llama step);
# - the LLVM module compiled whole, not split into parts for a thread pool (the default, 32 parts,
#   pays each part's setup: three workers already fill the two cores): about 12% less backend
#   compile time, 9% less CPU for three trainers' compiles (docs/benchmarks.md, "Test suite time").
# A flag the installed XLA does not know ends the process, so the process that starts the run
# tries them in a child and passes the known ones on to the workers.
FAST_CODEGEN = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _xla_knows(flags: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return probe.returncode == 0


if "MTJAX_TEST_FAST_CODEGEN" not in os.environ:
    known = list(FAST_CODEGEN) if _xla_knows(" ".join(FAST_CODEGEN)) else [f for f in FAST_CODEGEN if _xla_knows(f)]
    os.environ["MTJAX_TEST_FAST_CODEGEN"] = " ".join(known)
OURS = ("device_count", "xla_backend_optimization_level", *(f.split("=")[0] for f in FAST_CODEGEN))
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not any(o in f for o in OURS)]
    + ["--xla_force_host_platform_device_count=8",
       # LLVM's optimisation level only: cuts compile time (which dominates the suite) by about a
       # quarter; the HLO passes, and so the collectives and memory the tests read, are unchanged.
       "--xla_backend_optimization_level=0", *os.environ["MTJAX_TEST_FAST_CODEGEN"].split()])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Every process of a run shares its compiled programs through XLA's persistent cache: the xdist
# workers (a module's tests, and so its module-scoped trainers, may be split between workers, and
# several test files build the same tiny layouts) and the commands the tests start
# (`python -m mtjax.train` and the rest: one that finds its step compiled starts in about 10 s
# rather than 23 s). A deserialized program reads the same as a compiled one (its HLO text, memory
# and cost analyses), so the tests that read compiled programs are unaffected. The directory is made
# here, in the process that starts the run, before jax is imported (jax reads the setting once,
# at its first compile); the workers and the commands inherit it, and it goes with the run
# (`pytest_unconfigure`). The size bound turns on jax's file lock around each entry; an entry left
# unreadable (a run killed while writing it) is compiled again, and the warning that says so is
# silenced: the commands' stderr is asserted.
CACHE_WARNINGS = ("ignore:Error reading persistent compilation cache entry",
                  "ignore:Error writing persistent compilation cache entry")
OWNS_CACHE = "PYTEST_XDIST_WORKER" not in os.environ and "MTJAX_TEST_JAX_CACHE" not in os.environ
if OWNS_CACHE:
    os.environ["MTJAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="mtjax-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["MTJAX_TEST_JAX_CACHE"])
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *CACHE_WARNINGS]))
warnings.filterwarnings("ignore", "Error reading persistent compilation cache entry")
warnings.filterwarnings("ignore", "Error writing persistent compilation cache entry")


import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

# The longest tests (trainings of 100 steps, subprocess runs, multi-process launches) go first, so
# that with xdist no worker is still running one of them when the others have finished.
SLOW_FIRST = ("test_train.py", "test_faults.py", "test_multihost.py", "test_precision_recompute.py",
              "test_checkpoint.py", "test_distributed_optimizer.py", "test_notebooks.py")


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A test that runs a command in-process (`cli.run`) leaves SIGINT and SIGTERM ignored, as a
    command does once it has ended; ignored signals are inherited, so every process a later test
    of the same worker starts would ignore them (a launcher's `trap` cannot undo that). Put back."""
    import signal
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)
    items.sort(key=rank)          # stable: the order within each module is kept


def pytest_unconfigure(config):
    if OWNS_CACHE:
        shutil.rmtree(os.environ["MTJAX_TEST_JAX_CACHE"], ignore_errors=True)
