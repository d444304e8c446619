"""From the `data` config group to a tokenizer, train/validation datasets and the vocabulary size.

Data is checked before it trains anything: its index records how it was tokenized, which must
be how this run tokenizes (`data.tokenizer`, `data.eod_token`, `data.bos_token`, `data.add_bos`),
and the largest token id it records must be below the model's vocabulary (ids beyond it would
index past the embedding and train garbage).
What identifies the data (`Datasets.identity`) goes into every checkpoint, so that a resume on
other data is refused unless the user says `data.allow_change=true`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config
from mtjax.data import GPTDataset, IndexedDataset, default_corpus, load_tokenizer
from mtjax.data.errors import DataError
from mtjax.data.tokenizer import TokenOptionError, Tokenizer, describe, same_tokenizer


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


def config_tokenizer(cfg: Config) -> Tokenizer:
    """The tokenizer the `data` group describes; ConfigError naming data.eod_token, data.bos_token
    or data.add_bos when the tokenizer cannot do what they ask."""
    dc = cfg.data
    try:
        return load_tokenizer(dc.tokenizer, dc.eod_token, dc.bos_token, dc.add_bos)
    except TokenOptionError as e:
        raise ConfigError(f"data.{e.option}", str(e)) from None


def tokenizer_vocab(cfg: Config) -> int:
    return config_tokenizer(cfg).vocab_size


def check_tokenization(indexed: IndexedDataset, tokenizer: Tokenizer, cfg: Config) -> None:
    """The data was made by this tokenizer with this run's end- and beginning-of-document ids
    (the record its index holds); ConfigError naming the key and the .idx otherwise. Data whose
    index records nothing is refused: nothing says which tokenizer made it."""
    made, path = indexed.record, indexed.idx_path
    if made is None or "tokenizer" not in made:
        raise DataError(f"{path}: does not record which tokenizer made it; re-create it with "
                        f"`python -m mtjax.data.preprocess --tokenizer {cfg.data.tokenizer}`")
    if not same_tokenizer(made["tokenizer"], tokenizer.identity):
        raise ConfigError("data.tokenizer", f"{path} was made with the tokenizer {describe(made['tokenizer'])}, "
                                            f"this run's is {describe(tokenizer.identity)}; train with the "
                                            f"tokenizer that made the data, or make it again with this one"
                                            + ("" if cfg.data.path else " (data.path is empty: the built-in "
                                                                        "corpus is byte-tokenized)"))
    if made.get("eod_id") != tokenizer.eod_id:
        raise ConfigError("data.eod_token", f"{path} ends documents with id {made.get('eod_id')}, this run's "
                                            f"end-of-document token {tokenizer.token(tokenizer.eod_id)!r} is id "
                                            f"{tokenizer.eod_id}")
    if bool(made.get("add_bos")) != cfg.data.add_bos:
        raise ConfigError("data.add_bos", f"is {str(cfg.data.add_bos).lower()} but {path} was made "
                                          f"{'with' if made.get('add_bos') else 'without'} a BOS token before each document")
    if cfg.data.add_bos and made.get("bos_id") != tokenizer.bos_id:
        raise ConfigError("data.bos_token", f"{path} starts documents with id {made.get('bos_id')}, this run's "
                                            f"beginning-of-document token {tokenizer.token(tokenizer.bos_id)!r} is "
                                            f"id {tokenizer.bos_id}")


def check_ids_fit(indexed: IndexedDataset, vocab: int, cfg: Config) -> None:
    """DataError unless every token id of the corpus (its index records the largest) is < V."""
    if indexed.max_token_id >= vocab:
        source = f"model.vocab_size={vocab}" if cfg.model.vocab_size else f"data.tokenizer={cfg.data.tokenizer!r}"
        raise DataError(f"{indexed.idx_path}: token ids go up to {indexed.max_token_id}, but the vocabulary has "
                        f"{vocab} ids ({source}); was the data made with another tokenizer?")


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
    tokenizer = config_tokenizer(cfg)
    vocab = resolve_vocab(cfg, tokenizer.vocab_size)
    prefix = dc.path or _default_corpus(dc.cache_dir, workspace)
    indexed = IndexedDataset(prefix)
    check_tokenization(indexed, tokenizer, cfg)
    check_ids_fit(indexed, vocab, cfg)
    s, cache = cfg.model.seq_len, dc.cache_dir or None
    train = GPTDataset(indexed, s, dc.seed, "train", dc.valid_fraction, cache)
    valid = GPTDataset(indexed, s, dc.seed, "valid", dc.valid_fraction, cache) if dc.valid_fraction > 0 else None
    return Datasets(vocab, train, valid, prefix, describe(tokenizer.identity))


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
