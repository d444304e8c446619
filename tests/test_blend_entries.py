"""A corpus listed more than once in a blend ("0.3 web 0.3 web 0.4 code") is one corpus of the
summed weight: its entries share its samples, each read once per epoch whichever entry picks it
(numbered per entry, each sample was read by both entries, side by side in one global batch)."""
import os

import numpy as np

from layouts import tiny_config
from mtjax.data.blending import CHUNK, BlendedDataset
from mtjax.training.data_setup import build_datasets
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
