"""From the `data` config group to a tokenizer, train/validation datasets and the vocabulary size.

Data is checked before it trains anything: the largest token id the index records must be
below the model's vocabulary (ids beyond it would index past the embedding and train garbage).
What identifies the data (`Datasets.identity`) goes into every checkpoint, so that a resume on
other data is refused unless the user says `data.allow_change=true`.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config
from mtjax.data import GPTDataset, IndexedDataset, default_corpus, load_tokenizer
from mtjax.data.errors import DataError


@dataclass
class Datasets:
    vocab: int            # V, unpadded: the model's vocabulary
    train: GPTDataset
    valid: GPTDataset | None
    prefix: str           # the .bin/.idx prefix in use
    tokenizer: str = "byte"   # "byte", or the tokenizer file's name, size and CRC-32

    @property
    def identity(self) -> dict:
        """What a checkpoint records of the data it was trained on (compared on resume)."""
        return {"fingerprint": self.train.indexed.fingerprint, "tokenizer": self.tokenizer,
                "seed": self.train.seed, "valid_fraction": self.train.valid_fraction}

    def save_caches(self) -> None:
        """Write the sample-index caches; called once the run is accepted (a refused run writes nothing)."""
        for dataset in (self.train, self.valid):
            if dataset is not None:
                dataset.save_cache()


def resolve_vocab(cfg: Config, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's when 0; never smaller than the tokenizer's."""
    v = cfg.model.vocab_size or tokenizer_vocab
    if v < tokenizer_vocab:
        raise ConfigError("model.vocab_size", f"{v} is smaller than the tokenizer's vocabulary {tokenizer_vocab}")
    return v


def tokenizer_vocab(cfg: Config) -> int:
    return load_tokenizer(cfg.data.tokenizer).vocab_size


def check_ids_fit(indexed: IndexedDataset, vocab: int, cfg: Config) -> None:
    """DataError unless every token id of the corpus (its index records the largest) is < V."""
    if indexed.max_token_id >= vocab:
        source = f"model.vocab_size={vocab}" if cfg.model.vocab_size else f"data.tokenizer={cfg.data.tokenizer!r}"
        raise DataError(f"{indexed.idx_path}: token ids go up to {indexed.max_token_id}, but the vocabulary has "
                        f"{vocab} ids ({source}); was the data made with another tokenizer?")


def tokenizer_identity(spec: str) -> str:
    if spec == "byte":
        return "byte"
    crc = 0
    with open(spec, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{os.path.basename(spec)} ({os.path.getsize(spec)} bytes, crc32 {crc:08x})"


def build_datasets(cfg: Config, workspace=None) -> Datasets:
    """Open (or build, for the default corpus) the token files and the sample indices, and check
    the ids fit the vocabulary. Writes nothing but a default corpus that is missing (given to
    `workspace`, which removes it if the run is refused); the sample-index caches are written
    by `save_caches`.

    With several processes every one builds what is missing, with no barrier:
    the builds are deterministic and each file is written under a temporary name
    and renamed into place (IndexedWriter, GPTDataset's cache), so concurrent
    builders on a shared cache directory leave one complete file, never a torn one.
    A barrier would save the duplicate work but hang every peer if process 0 failed.
    """
    dc = cfg.data
    vocab = resolve_vocab(cfg, tokenizer_vocab(cfg))
    prefix = dc.path or _default_corpus(dc.cache_dir, workspace)
    indexed = IndexedDataset(prefix)
    check_ids_fit(indexed, vocab, cfg)
    s, cache = cfg.model.seq_len, dc.cache_dir or None
    train = GPTDataset(indexed, s, dc.seed, "train", dc.valid_fraction, cache)
    valid = GPTDataset(indexed, s, dc.seed, "valid", dc.valid_fraction, cache) if dc.valid_fraction > 0 else None
    return Datasets(vocab, train, valid, prefix, tokenizer_identity(dc.tokenizer))


def _default_corpus(cache_dir: str, workspace) -> str:
    """The stdlib corpus's prefix; its files, when this call builds them, go to `workspace`."""
    try:
        if workspace is None:
            return default_corpus(cache_dir)
        workspace.make_dirs(cache_dir)
        before = set(os.listdir(cache_dir))
        prefix = default_corpus(cache_dir)
    except OSError as e:
        raise ConfigError("data.cache_dir", f"cannot build the default corpus in {cache_dir}: "
                                            f"{e.strerror or e}") from None
    workspace.created(*[p for p in (prefix + ".bin", prefix + ".idx") if os.path.basename(p) not in before])
    return prefix
