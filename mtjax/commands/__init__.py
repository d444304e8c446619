"""The command-line programs that live above the library, one module each (the top layer, see
docs/design.md "Layers of the system"). Each keeps its `python -m` name through a shim in place:

  pipeline.py     python -m mtjax.pipeline show ...     (shim mtjax/pipeline/__main__.py)
  preprocess.py   python -m mtjax.data.preprocess ...   (shim mtjax/data/preprocess.py)
  convert.py      python -m mtjax.convert from-hf|to-hf (shim mtjax/convert/__main__.py)
  convert_hf.py   `from_hf` and `to_hf`, the two conversions the convert command runs
  config.py       python -m mtjax.config [GROUP ...]        (shim mtjax/config/__main__.py)

`python -m mtjax.train`, `mtjax.inspect` and `mtjax.generate` are top-level modules of this layer,
beside the helpers every command shares (`mtjax.cli`, `mtjax.cli_checks`, `mtjax.plots`).
Nothing is imported here, so that `python -m` never finds its module pre-imported.
"""
