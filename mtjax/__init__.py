"""mtjax: Megatron-LM's parallelism in JAX. `import mtjax` stays light: `mtjax.load` imports JAX and
the model only when called."""


def load(checkpoint: str, mesh=None, overrides=()):
    """A checkpoint opened for inference on `mesh`, or on the mesh `overrides` name
    (`parallel.data/pipe/tensor=...`): `.logits(tokens)` and `.generate(prompt_ids, ...)`; only
    the parameters are read and nothing of training is built (`mtjax.inference.model.load`)."""
    from mtjax.inference import load as load_checkpoint
    return load_checkpoint(checkpoint, mesh, overrides)


__all__ = ["load"]
