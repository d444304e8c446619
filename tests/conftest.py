"""Every test runs on 8 simulated CPU devices, in fp32, with rank promotion as an error."""
import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8",
       # LLVM's optimisation level only: cuts compile time (which dominates the suite) by about a
       # quarter; the HLO passes, and so the collectives and memory the tests read, are unchanged.
       "--xla_backend_optimization_level=0"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

# The longest tests (trainings of 100 steps, subprocess runs, multi-process launches) go first, so
# that with xdist no worker is still running one of them when the others have finished.
SLOW_FIRST = ("test_train.py", "test_faults.py", "test_multihost.py", "test_precision_recompute.py",
              "test_checkpoint.py", "test_distributed_optimizer.py", "test_notebooks.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)
    items.sort(key=rank)          # stable: the order within each module is kept


# The commands the tests start (`python -m mtjax.train` and the rest, some ten of them on the same
# tiny model) share their compiled programs through XLA's persistent cache, one for the whole
# session (the xdist workers' temporary directories have one parent): a run that finds its step
# compiled starts in about 10 s rather than 23 s. This process is untouched (jax read its settings
# at import; the tests that read compiled programs compile their own). The size bound turns on
# jax's file lock around each entry; an entry left unreadable (a run killed while writing it) is
# compiled again, and the warning that says so is silenced: the commands' stderr is asserted.
CACHE_WARNINGS = ("ignore:Error reading persistent compilation cache entry",
                  "ignore:Error writing persistent compilation cache entry")


@pytest.fixture(scope="session", autouse=True)
def subprocess_compilation_cache(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "jax-cache"))
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *CACHE_WARNINGS]))
