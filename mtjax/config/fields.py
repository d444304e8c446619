"""`doc`, the one way every schema field is declared (`schema.py`, `model_schema.py`)."""
from __future__ import annotations

from dataclasses import field


def doc(default, meaning: str):
    """A field with its default and its one-line meaning (`field.metadata["help"]`)."""
    return field(default=default, metadata={"help": meaning})
