"""From the `data` config group to a tokenizer, train/validation datasets and the vocabulary size."""
from __future__ import annotations

from dataclasses import dataclass

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config
from mtjax.data import GPTDataset, IndexedDataset, default_corpus, load_tokenizer


@dataclass
class Datasets:
    vocab: int            # V, unpadded: the model's vocabulary
    train: GPTDataset
    valid: GPTDataset | None
    prefix: str           # the .bin/.idx prefix in use


def resolve_vocab(cfg: Config, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's when 0; never smaller than the tokenizer's."""
    v = cfg.model.vocab_size or tokenizer_vocab
    if v < tokenizer_vocab:
        raise ConfigError("model.vocab_size", f"{v} is smaller than the tokenizer's vocabulary {tokenizer_vocab}")
    return v


def tokenizer_vocab(cfg: Config) -> int:
    return load_tokenizer(cfg.data.tokenizer).vocab_size


def build_datasets(cfg: Config) -> Datasets:
    """Open (or build, for the default corpus) the token files and the sample indices.

    With several processes every one builds what is missing, with no barrier:
    the builds are deterministic and each file is written under a temporary name
    and renamed into place (IndexedWriter, GPTDataset's cache), so concurrent
    builders on a shared cache directory leave one complete file, never a torn one.
    A barrier would save the duplicate work but hang every peer if process 0 failed.
    """
    dc = cfg.data
    vocab = resolve_vocab(cfg, tokenizer_vocab(cfg))
    prefix = dc.path or default_corpus(dc.cache_dir)
    indexed = IndexedDataset(prefix)
    s = cfg.model.seq_len
    train = GPTDataset(indexed, s, dc.seed, "train", dc.valid_fraction, dc.cache_dir)
    valid = GPTDataset(indexed, s, dc.seed, "valid", dc.valid_fraction, dc.cache_dir) if dc.valid_fraction > 0 else None
    return Datasets(vocab, train, valid, prefix)
