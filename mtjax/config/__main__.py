"""`python -m mtjax.config ...`: an entry shim. The command is `mtjax.commands.config`, run here as `__main__`
by name, so this library package imports nothing from the command layer above it."""
import runpy

if __name__ == "__main__":
    runpy.run_module("mtjax.commands.config", run_name="__main__", alter_sys=True)
