"""The one exception type of the data pipeline.

Every problem with user-supplied data (a missing or corrupted token file, a
malformed JSON line, a split too small for one sample) raises `DataError`
with a one-line message that names the file and says what is wrong, so a CLI
can print it as-is and a trainer can fail before its first step.
"""


class DataError(ValueError):
    """Bad or missing input data; the message is one line naming the file."""


def one_line(e: BaseException) -> str:
    """An exception's message on one line (a library's may span several), or its type's name."""
    return " ".join(str(e).split()) or type(e).__name__


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words ("a number", "null"), for error lines."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = ((str, "a string"), ((int, float), "a number"), (list, "an array"), (dict, "an object"))
    return next((kind for types, kind in kinds if isinstance(value, types)), type(value).__name__)
