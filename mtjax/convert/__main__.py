"""`python -m mtjax.convert ...`: an entry shim; the command is `mtjax.commands.convert`."""
from mtjax import cli
from mtjax.commands.convert import main

if __name__ == "__main__":
    cli.run(main)
