"""`python -m mtjax.data.preprocess ...`: an entry shim. The command is
`mtjax.commands.preprocess`, run here as `__main__`
by name, so this library package imports nothing from the command layer above it."""
import runpy

if __name__ == "__main__":
    runpy.run_module("mtjax.commands.preprocess", run_name="__main__", alter_sys=True)
