"""A corpus listed more than once in a blend ("0.3 web 0.3 web 0.4 code") is one corpus of the
summed weight: its entries share its samples, each read once per epoch whichever entry picks it
(numbered per entry, each sample was read by both entries, side by side in one global batch)."""
import os
from types import SimpleNamespace

import numpy as np
import pytest

from layouts import tiny_config
from mtjax.data.blending import CHUNK, BlendedDataset
from mtjax.training.data_setup import build_datasets
from mtjax.training.loop import evaluate
from test_blend import Tagged, write_corpus


def test_entries_of_one_dataset_read_its_samples_once_in_order():
    web, code = Tagged(0), Tagged(1)
    blend = BlendedDataset([web, code, web], [0.3, 0.4, 0.3])
    n = 2 * CHUNK + 777                                       # across chunks, and a cut inside one
    blend.extend_to(n)
    corpus, sample = blend.corpus[:n], blend.sample[:n]
    from_web = np.isin(corpus, (0, 2))
    np.testing.assert_array_equal(sample[from_web], np.arange(from_web.sum()))    # 0, 1, 2, ... once each
    np.testing.assert_array_equal(sample[~from_web], np.arange((~from_web).sum()))
    assert abs(from_web.sum() - 0.6 * n) < 3                   # the summed weight, within K of it
    for i in (5, 6, CHUNK + 3, n - 1):                          # what a read returns: (the dataset, its sample)
        assert tuple(blend[i]) == (0 if from_web[i] else 1, sample[i])
    resumed = BlendedDataset([web, code, web], [0.3, 0.4, 0.3], window=CHUNK)      # a resume deep in the stream:
    assert tuple(resumed[n - 1]) == (0 if from_web[n - 1] else 1, sample[n - 1])   # the chunks before, not kept
    assert resumed.first > 0


def test_a_corpus_listed_twice_gives_no_sample_twice(tmp_path):
    web, code = write_corpus(tmp_path / "web", 0, 97, 123), write_corpus(tmp_path / "code", 1, 48, 58)
    os.symlink(web + ".bin", tmp_path / "alias.bin")            # the same files under another prefix
    os.symlink(web + ".idx", tmp_path / "alias.idx")
    cfg = tiny_config(extra=[f"data.path=0.3 {web} 0.4 {code} 0.3 {tmp_path}/alias", "data.valid_fraction=0.1",
                             f"data.cache_dir={tmp_path}/cache", f"train.run_dir={tmp_path}/run"])
    data = build_datasets(cfg)
    assert data.corpora[0] is data.corpora[2] and data.corpora[0] is not data.corpora[1]
    rows = [tuple(data.train[i].tolist()) for i in range(60)]
    assert len(set(rows)) == len(rows)
    web_rows = [r for r in rows if set(r) - {256} <= set(range(97, 123))]
    alone = data.corpora[0]
    assert web_rows == [tuple(alone[j].tolist()) for j in range(len(web_rows))]       # web's own order
    assert 0.5 < len(web_rows) / len(rows) < 0.7


class Counting:
    """The parts of a Trainer `evaluate` uses, with an eval step that counts the batches it sees."""

    def __init__(self, cfg):
        self.local_rows, self.batches = None, []
        self.plan = SimpleNamespace(masks_loss=False, tokens_per_step=cfg.train.global_batch * cfg.model.seq_len)

    def put_batch(self, batch):
        return batch

    def eval_step(self, params, batch):
        self.batches.append(batch)
        return float(batch[0, 0])            # a loss that tells the corpora apart


def test_a_corpus_listed_twice_is_evaluated_once(tmp_path):
    web, code = write_corpus(tmp_path / "web", 0, 97, 123), write_corpus(tmp_path / "code", 1, 48, 58)
    blend = f"data.path=0.3 {web} 0.4 {code} 0.3 {web}"
    for extra in (["data.valid_fraction=0.1"], ["data.valid_fraction=0", f"data.valid_path=1 {web} 2 {code} 1 {web}"]):
        cfg = tiny_config(extra=[blend, f"data.cache_dir={tmp_path}/cache", f"train.run_dir={tmp_path}/run",
                                 "train.eval_batches=2", *extra])
        data = build_datasets(cfg)
        assert data.valid[0].dataset is data.valid[2].dataset is not data.valid[1].dataset
        trainer = Counting(cfg)
        row = evaluate(trainer, None, data.valid, cfg)
        assert len(trainer.batches) == 2 * 2                                 # two corpora, two batches each
        names = [f"val_loss/{v.name}" for v in data.valid]
        assert row[names[0]] == row[names[2]] != row[names[1]]
        assert row["val_loss"] == pytest.approx(sum(v.weight * row[n] for v, n in zip(data.valid, names)))
