"""`python -m mtjax.pipeline ...`: an entry shim; the command is `mtjax.commands.pipeline`."""
import sys

from mtjax.commands.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
