"""From the `data` config group to a tokenizer, train/validation datasets and the vocabulary size.

Data is checked before it trains anything: its index records how it was tokenized, which must
be how this run tokenizes (`data.tokenizer`, `data.eod_token`, `data.bos_token`, `data.add_bos`;
all taken from the index when `data.tokenizer` is unset: `recorded_tokenization`), and the
largest token id it records must be below the model's vocabulary (ids beyond it would index
past the embedding and train garbage).
What identifies the data (`Datasets.identity`) goes into every checkpoint, so that a resume on
other data is refused unless the user says `data.allow_change=true`.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from mtjax.config.data_path import corpora, entry_key
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config, Corpus
from mtjax.data import GPTDataset, IndexedDataset
from mtjax.data.corpus import default_corpus, default_prefix
from mtjax.data.blending import BlendedDataset
from mtjax.data.errors import DataError
from mtjax.data.open_files import OpenFiles
from mtjax.data.packed_dataset import PackedDataset
from mtjax.data.sft import is_sft
from mtjax.data.tokenizer import Tokenizer, config_tokenizer, describe, same_tokenizer
from mtjax.training.recorded_tokenization import completed_config


@dataclass(frozen=True)
class ValidSet:
    """One validation corpus: its metrics name (`val_loss/<name>`; "" when it is the only one
    and not part of a blend), its share of the blend's validation loss, and its samples."""
    name: str
    weight: float
    dataset: GPTDataset


@dataclass
class Datasets:
    vocab: int            # V, unpadded: the model's vocabulary
    train: GPTDataset | BlendedDataset
    valid: tuple[ValidSet, ...] | None
    prefix: str           # the data in use, as the start-up line names it
    tokenizer: str = "byte"   # "byte", or the tokenizer file's name, size and CRC-32
    corpora: tuple[GPTDataset, ...] = ()     # the training corpora (one, or the blend's)
    valid_fraction: float = 0.0              # held out of each training corpus (0 with data.valid_path)
    config: Config | None = None             # the run's config, its tokenization completed from the data's
                                             # index (`recorded_tokenization`): what the run saves
    eod: int = -1                            # the tokenizer's end-of-document id (packed rows read it)

    @property
    def identity(self) -> dict | None:
        """What a checkpoint records of the data it was trained on (compared on resume): the
        corpora's content (one fingerprint: the corpus's, or a hash of the blend's in order), the
        blend's weights as it uses them, the tokenizer, the split seed and held-out fraction."""
        if not self.corpora:
            return None
        prints = [c.indexed.fingerprint for c in self.corpora]
        out = {"fingerprint": prints[0] if len(prints) == 1 else
               hashlib.sha256(json.dumps(prints).encode()).hexdigest()[:32],
               "tokenizer": self.tokenizer, "seed": self.corpora[0].seed, "valid_fraction": self.valid_fraction}
        if isinstance(self.train, BlendedDataset):
            out["weights"] = [round(w, 9) for w in self.train.shares]
        return out

    def save_caches(self) -> None:
        """Write the sample-index caches; called once the run is accepted (a refused run writes nothing)."""
        for dataset in (*self.corpora, *(v.dataset for v in self.valid or ())):
            dataset.save_cache()


def resolve_vocab(cfg: Config, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's when 0; never smaller than the tokenizer's."""
    v = cfg.model.vocab_size or tokenizer_vocab
    if v < tokenizer_vocab:
        raise ConfigError("model.vocab_size", f"{v} is smaller than the tokenizer's vocabulary {tokenizer_vocab}")
    return v


def tokenizer_vocab(cfg: Config) -> int:
    return config_tokenizer(completed_config(cfg)).vocab_size


def check_tokenization(indexed: IndexedDataset, tokenizer: Tokenizer, cfg: Config) -> None:
    """The data was made by this tokenizer with this run's end- and beginning-of-document ids
    (the record its index holds); ConfigError naming the key and the .idx otherwise. Data whose
    index records nothing is refused with a DataError: nothing says which tokenizer made it."""
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
                                          f"{'with' if made.get('add_bos') else 'without'} a BOS token before "
                                          "each document")
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
    every corpus was made by this run's tokenizer and its ids fit the vocabulary. Writes nothing
    but a default corpus that is missing (given to `workspace`, which removes it if the run is
    refused); the sample-index caches are written by `save_caches`.

    `data.path` is one prefix or a blend (`BlendedDataset`, Megatron's weighted blending).
    Validation is `data.valid_path` when set (every document of each of its corpora), else the
    held-out `valid_fraction` of each training corpus, weighted as the training blend.

    With several processes every one builds what is missing, with no barrier:
    the builds are deterministic and each file is written under a temporary name
    and renamed into place (IndexedWriter, GPTDataset's cache), so concurrent
    builders on a shared cache directory leave one complete file, never a torn one.
    A barrier would save the duplicate work but hang every peer if process 0 failed.
    """
    cfg = completed_config(cfg)
    dc = cfg.data
    tokenizer = config_tokenizer(cfg)
    vocab = resolve_vocab(cfg, tokenizer.vocab_size)
    train_list = corpora(dc.path) or (Corpus(1.0, _default_corpus(dc.cache_dir, workspace)),)
    fraction = 0.0 if dc.valid_path else dc.valid_fraction
    files = OpenFiles()       # every corpus, training and validation, mapped through it: a bounded number at once
    seen: dict = {}           # each corpus opened (and its .bin checked) once, however often it is listed
    opened = [_open(cfg, c.path, tokenizer, vocab, files, seen) for c in train_list]
    train = _split_sets(cfg, "data.path", dc.path, opened, "train", fraction)
    weights = [c.weight for c in train_list]
    if dc.valid_path:
        valid_list = corpora(dc.valid_path)
        valid = _split_sets(cfg, "data.valid_path", dc.valid_path,
                            [_open(cfg, c.path, tokenizer, vocab, files, seen) for c in valid_list], "valid", 1.0)
        valid_sets = _valid_sets(valid_list, valid, isinstance(dc.valid_path, tuple))
    elif fraction > 0:
        valid = _split_sets(cfg, "data.path", dc.path, opened, "valid", fraction)
        valid_sets = _valid_sets(train_list, valid, isinstance(dc.path, tuple))
    else:
        valid_sets = None
    blend = BlendedDataset(train, weights) if len(train) > 1 else train[0]
    return Datasets(vocab, blend, valid_sets, describe_path(train_list), describe(tokenizer.identity), train, fraction,
                    cfg, tokenizer.eod_id)


def _open(cfg: Config, prefix: str, tokenizer: Tokenizer, vocab: int, files: OpenFiles, seen: dict) -> IndexedDataset:
    """One corpus's token files, checked against the run's tokenization and vocabulary, read through `files`;
    the one in `seen` when its files (links resolved) were opened already."""
    key = (os.path.realpath(prefix + ".bin"), os.path.realpath(prefix + ".idx"))
    if key not in seen:
        indexed = IndexedDataset(prefix, files=files)
        check_tokenization(indexed, tokenizer, cfg)
        check_ids_fit(indexed, vocab, cfg)
        seen[key] = indexed
    return seen[key]


def _split_sets(cfg: Config, key: str, value, opened: list[IndexedDataset], split: str, fraction: float) -> tuple:
    """Each entry's samples of the split (the entries of `key`, data.path or data.valid_path, set
    to `value`); the entries naming one corpus (one `_open`ed dataset) share one, so that a
    training blend reads its samples once for all of them (`blending.BlendedDataset`: a corpus
    listed twice is one corpus of the summed weight) and validation evaluates it once
    (`loop.evaluate`)."""
    made: dict[int, GPTDataset | PackedDataset] = {}
    for i, x in enumerate(opened):
        if id(x) not in made:
            made[id(x)] = _samples(cfg, key, value, i, x, split, fraction)
    return tuple(made[id(x)] for x in opened)


def _samples(cfg: Config, key: str, value, i: int, indexed: IndexedDataset, split: str,
             fraction: float) -> GPTDataset:
    """The split's samples (fine-tuning samples packed into rows, which needs data.document_masking:
    ConfigError otherwise); a corpus too short for one is a ConfigError naming the entry (the
    DataError itself for the built-in corpus, which no entry names)."""
    try:
        if is_sft(indexed.record):    # fine-tuning samples: packed whole into rows (`packed_dataset.py`)
            if not cfg.data.document_masking:
                raise ConfigError("data.document_masking", f"{indexed.prefix} holds fine-tuning samples, packed "
                                                           "several to a row: set data.document_masking=true")
            return PackedDataset(indexed, cfg.model.seq_len, cfg.data.seed, indexed.record["eod_id"], split, fraction)
        return GPTDataset(indexed, cfg.model.seq_len, cfg.data.seed, split, fraction, cfg.data.cache_dir or None)
    except DataError as e:
        if not value:
            raise
        raise ConfigError(entry_key(key, value, i), str(e)) from None


def _valid_sets(listed, datasets, blended: bool) -> tuple[ValidSet, ...]:
    """Named validation sets: by the prefix's last component (the whole prefix where two share
    it, and `#<entry>` after it where one is listed twice); a single prefix that is not a blend
    is unnamed (`val_loss` only)."""
    if not blended:
        return (ValidSet("", 1.0, datasets[0]),)
    short = [os.path.basename(c.path.rstrip("/")) or c.path for c in listed]
    names = [s if short.count(s) == 1 else c.path for s, c in zip(short, listed)]
    names = [n if names.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(names)]   # one corpus listed twice
    total = sum(c.weight for c in listed)
    return tuple(ValidSet(n, c.weight / total, d) for n, c, d in zip(names, listed, datasets))


def describe_path(listed) -> str:
    """'data/web' or '0.7 data/web + 0.3 data/code' (the weights normalised)."""
    if len(listed) == 1:
        return listed[0].path
    total = sum(c.weight for c in listed)
    return " + ".join(f"{c.weight / total:.4g} {c.path}" for c in listed)


def _default_corpus(cache_dir: str, workspace) -> str:
    """The stdlib corpus's prefix; its files, when this call builds them, go to `workspace`."""
    try:
        if workspace is None:
            return default_corpus(cache_dir)
        workspace.make_dirs(cache_dir)
        # named before the build: a signal just after its last rename must not leave the files behind
        prefix = default_prefix(cache_dir)
        workspace.created(*[p for p in (prefix + ".bin", prefix + ".idx") if not os.path.exists(p)])
        return default_corpus(cache_dir)
    except OSError as e:
        raise ConfigError("data.cache_dir", f"cannot build the default corpus in {cache_dir}: "
                                            f"{e.strerror or e}") from None
