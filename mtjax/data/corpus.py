"""The embedded default corpus: the Python standard library's own source.

Every Python installation carries a few MB of real, varied text (code,
docstrings, comments), so training and tests need no download. The corpus is

    the *.py files under sysconfig's "stdlib" directory, sorted by their
    relative POSIX path, skipping SKIPPED_DIRS (site-packages and test
    suites) and files that are not valid UTF-8, taking the longest prefix of
    that list whose UTF-8 text totals at most `max_bytes` (DEFAULT_MAX_BYTES,
    8 MiB: a few seconds to build);

one document per file, byte-tokenized, each document ending with EOD. It is
deterministic for a given Python installation, and built once per cache
directory under a name that records the Python version, the cap and the index
format version (a cache in an older format is never reused).
"""

from __future__ import annotations

import os
import platform
import sysconfig

from mtjax.data.indexed import FORMAT_VERSION, IndexedWriter, dtype_for_vocab
from mtjax.data.tokenizer import ByteTokenizer, record

DEFAULT_MAX_BYTES = 8 << 20
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, str]]:
    """(relative path, text) of the corpus files, in corpus order."""
    root = sysconfig.get_paths()["stdlib"]
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        relpaths += [os.path.normpath(os.path.join(rel_dir, f)) for f in filenames if f.endswith(".py")]
    relpaths.sort(key=lambda p: p.replace(os.sep, "/"))
    sources, total = [], 0
    for rel in relpaths:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if total + len(raw) > max_bytes:
            break
        sources.append((rel.replace(os.sep, "/"), text))
        total += len(raw)
    return sources


def default_prefix(cache_dir: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Where `default_corpus` keeps (or builds) the corpus: PREFIX.bin and PREFIX.idx."""
    return os.path.join(cache_dir, f"stdlib-py{platform.python_version()}-max{max_bytes}-idx{FORMAT_VERSION}")


def default_corpus(cache_dir: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Prefix of the stdlib corpus's .bin/.idx in `cache_dir`, building it if absent.

    The write is atomic (see `IndexedWriter`): concurrent builds leave one
    complete dataset, and an interrupted one (an exception, `Interrupted` by a
    signal included) leaves nothing, not even a temporary file.
    """
    os.makedirs(cache_dir, exist_ok=True)
    prefix = default_prefix(cache_dir, max_bytes)
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return prefix
    tokenizer = ByteTokenizer()
    with IndexedWriter(prefix, dtype_for_vocab(tokenizer.vocab_size), record(tokenizer, add_bos=False)) as writer:
        for _, text in stdlib_sources(max_bytes):
            writer.add_document(tokenizer.encode(text) + [tokenizer.eod_id])
    return prefix
