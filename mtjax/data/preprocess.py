"""`python -m mtjax.data.preprocess ...`: an entry shim; the command is `mtjax.commands.preprocess`."""
import sys

from mtjax.commands.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
