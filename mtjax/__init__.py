"""mtjax: Megatron-LM's parallelism in JAX. `import mtjax` stays light: `mtjax.load` imports JAX and
the model only when called, `mtjax.train` (the callable module `mtjax/train.py`) when first used."""


def load(checkpoint: str, mesh=None, overrides=()):
    """A checkpoint opened for inference: `.logits(tokens)` and `.generate(prompt_ids, ...)`; see
    `mtjax.inference.model.load`."""
    from mtjax.inference import load as load_checkpoint
    return load_checkpoint(checkpoint, mesh, overrides)


def __getattr__(name: str):
    # `mtjax.train(config, overrides)`: the command's module is the function (see mtjax/train.py)
    if name == "train":
        import importlib
        return importlib.import_module("mtjax.train")
    raise AttributeError(f"module 'mtjax' has no attribute {name!r}")


__all__ = ["load", "train"]
