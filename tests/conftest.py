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
