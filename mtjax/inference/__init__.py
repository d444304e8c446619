"""Inference from a checkpoint: `load` (`model.py`), generation with a KV cache (`decode.py`),
and the choice of each next token (`sampling.py`)."""
from mtjax.inference.model import InferenceModel, load

__all__ = ["InferenceModel", "load"]
