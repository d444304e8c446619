"""Weighted blends of corpora (data.path as weight-prefix pairs) and separate validation sets.

The blending index is checked in numpy against Megatron's rule written out here; the
training-level properties (same batches on any layout, bitwise resume mid-blend, weights
refused when changed, per-corpus validation losses) on one tiny trainer compiled once; bad
inputs through the command line's own entry point, in-process."""
import dataclasses
import json
from fractions import Fraction

import numpy as np
import pytest

from layouts import build, tiny_config
from mtjax import cli
from mtjax.config import load_config, validate
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Corpus, DataConfig
from mtjax.data import BatchLoader, ByteTokenizer, GPTDataset, IndexedDataset, IndexedWriter
from mtjax.data.blending import CHUNK, BlendedDataset, BlendState, blend_positions, quantise
from mtjax.data.tokenizer import record
from mtjax.training import loop
from mtjax.checkpoint import Checkpointer
from mtjax.training.data_setup import build_datasets
from mtjax.training.metrics import MetricsWriter
from test_cli import TINY, snapshot


class Tagged:
    """A dataset whose sample j of corpus k is (k, j): what the blend asked for, readable."""

    def __init__(self, k):
        self.k = k

    def __getitem__(self, j):
        return np.array([self.k, j])


def megatron(weights, n):
    """Megatron's rule, exactly (rationals): position i takes the corpus k maximising
    w_k * max(i, 1) - c_k (the first on ties), and its sample c_k."""
    w = [Fraction(int(q), int(sum(weights))) for q in weights]
    count, out = [0] * len(w), []
    for i in range(n):
        deficit = [w[k] * max(i, 1) - count[k] for k in range(len(w))]
        k = deficit.index(max(deficit))
        out.append((k, count[k]))
        count[k] += 1
    return np.array(out)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [5, 1, 1, 3], [1e-3, 1, 0.25, 0.25, 2]])
def test_blend_shares_follow_the_weights_and_megatrons_rule(weights):
    blend = BlendedDataset([Tagged(k) for k in range(len(weights))], weights)
    n = 10_000
    picks = np.stack([blend[i] for i in range(n)])
    np.testing.assert_array_equal(picks, megatron(quantise(weights), n))
    share = np.asarray(weights) / np.sum(weights)
    blend.extend_to(2 * CHUNK)
    for lo in (0, 3_333, CHUNK - 5_000):                   # any window of n positions, across chunks too
        counts = np.bincount(blend.corpus[lo:lo + n], minlength=len(weights))
        assert np.all(np.abs(counts - share * n) < len(weights)), (lo, counts, share * n)   # the rule's bound
        big = share * n >= 500                              # within 1% of the weight (5% and above)
        assert np.all(np.abs(counts[big] / n - share[big]) <= 0.01 * share[big]), (lo, counts, share)
    # each corpus reads its own samples in order, none twice
    for k in range(len(weights)):
        mine = picks[picks[:, 0] == k, 1]
        np.testing.assert_array_equal(mine, np.arange(len(mine)))


def test_the_index_computed_in_pieces_is_the_index_computed_at_once():
    q = quantise([0.5, 0.25, 0.125, 0.125])
    whole, whole_j, _ = blend_positions(q, BlendState.start(q), CHUNK + 777)
    a, aj, state = blend_positions(q, BlendState.start(q), 1234)
    b, bj, _ = blend_positions(q, state, CHUNK + 777 - 1234)
    np.testing.assert_array_equal(np.concatenate([a, b]), whole)
    np.testing.assert_array_equal(np.concatenate([aj, bj]), whole_j)
    late = BlendedDataset([Tagged(k) for k in range(4)], [0.5, 0.25, 0.125, 0.125])
    assert [tuple(late[i]) for i in (CHUNK + 700, 5)] == [(whole[CHUNK + 700], whole_j[CHUNK + 700]), (whole[5], whole_j[5])]


def test_a_corpus_count_past_two_to_the_31_is_exact():
    """The state m S positions later, every corpus having given m W_k more samples, has the same
    deficits: the same picks follow, each sample number m W_k higher, past 2^31 (int32 in the scan)."""
    q = quantise([0.5, 0.3, 0.2])
    m = -(-(1 << 31) // int(q.min()))                          # every count passes 2^31
    k, j, state = blend_positions(q, BlendState.start(q), 1000)
    later = BlendState(state.position + m * int(q.sum()), state.deficit, state.count + m * q)
    assert later.count.min() >= 1 << 31
    k2, j2, after = blend_positions(q, later, 3000)
    k1, j1, before = blend_positions(q, state, 3000)
    np.testing.assert_array_equal(k2, k1)
    np.testing.assert_array_equal(j2, j1 + m * q[k1])
    np.testing.assert_array_equal(after.count, before.count + m * q)


def test_a_blend_keeps_a_window_of_positions_and_reads_any_position():
    """Reading forward keeps at most twice the window (10 bytes a position, not per position ever
    read); a jump past it computes the chunks between without keeping them; a position before the
    window is computed again. Every read equals the index computed at once."""
    q, n = quantise([0.5, 0.3, 0.2]), 13 * CHUNK
    whole, whole_j, _ = blend_positions(q, BlendState.start(q), n)
    blend = BlendedDataset([Tagged(k) for k in range(3)], [0.5, 0.3, 0.2], window=2 * CHUNK)
    reads = [*range(0, 6 * CHUNK, CHUNK // 3), 12 * CHUNK + 5, 3, 11 * CHUNK - 1, 9 * CHUNK]
    for i in reads:
        assert tuple(blend[i]) == (whole[i], whole_j[i]), i
        assert len(blend.corpus) <= 4 * CHUNK + CHUNK and blend.first <= i < len(blend)
    assert blend.first > 0


def write_corpus(prefix, seed, lo, hi, docs=120):
    """Byte-tokenized random documents with ids in [lo, hi), each ending in EOD."""
    rng, tok = np.random.default_rng(seed), ByteTokenizer()
    with IndexedWriter(str(prefix), np.uint16, record(tok, False)) as w:
        for _ in range(docs):
            w.add_document(list(rng.integers(lo, hi, rng.integers(10, 80))) + [tok.eod_id])
    return str(prefix)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return {"root": root, "web": write_corpus(root / "web", 0, 97, 123), "code": write_corpus(root / "code", 1, 48, 58),
            "tiny": write_corpus(root / "tiny", 2, 97, 123, docs=1)}


def blend_config(corpora, run_dir, layout=(1, 1, 1), weights=(0.7, 0.3), extra=()):
    d, p, t = layout
    return tiny_config("gpt", t, p, d, extra=[
        f"data.path={weights[0]} {corpora['web']} {weights[1]} {corpora['code']}", f"data.cache_dir={run_dir}/cache",
        f"train.run_dir={run_dir}", "train.log_interval=1", "train.eval_interval=2", "train.eval_batches=1",
        "train.progress=false", "checkpoint.interval=2", "data.valid_fraction=0.1", *extra])


def test_the_same_blend_gives_the_same_global_batches_on_any_layout(corpora, tmp_path):
    batches = []
    for layout in ((1, 1, 1), (2, 2, 2)):
        cfg = blend_config(corpora, tmp_path / str(layout), layout)
        data = build_datasets(cfg)
        trainer = build(cfg, *layout)
        loader = BatchLoader(data.train, cfg.train.global_batch, position=40, rows=trainer.local_rows)
        batches.append([np.asarray(trainer.put_batch(loader.next_batch())) for _ in range(3)])
    for a, b in zip(*batches):
        np.testing.assert_array_equal(a, b)
    web = set(range(97, 123))         # the two corpora's ids do not overlap: each row is one corpus's
    rows = np.concatenate(batches[0])
    from_web = [bool(set(r[r != 256].tolist()) <= web) for r in rows]
    assert 0.5 < np.mean(from_web) < 0.9


def train(cfg, trainer, data, state=None, checkpointer=None):
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, progress=False, enabled=False)
    return loop.train(cfg, trainer, data, writer, state, checkpointer)


def test_resume_mid_blend_is_bitwise_and_reports_each_corpus(corpora, tmp_path):
    whole = blend_config(corpora, tmp_path / "whole", extra=["train.steps=4"])
    trainer = build(whole, 1, 1, 1)
    straight = train(whole, trainer, build_datasets(whole)).rows

    first = blend_config(corpora, tmp_path / "cut", extra=["train.steps=2"])
    data = build_datasets(first)
    ck = Checkpointer(first, data=data.identity)
    train(first, trainer, data, checkpointer=ck)
    ck.close()
    then = blend_config(corpora, tmp_path / "cut", extra=["train.steps=4"])
    data = build_datasets(then)                                     # a fresh blend index, read from position 16
    ck = Checkpointer(then, data=data.identity)
    state = ck.restore(ck.latest_valid(), trainer)
    assert int(state.data_position) == 2 * whole.train.global_batch
    resumed = train(then, trainer, data, state, ck).rows
    ck.close()
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]         # bitwise

    # per-corpus validation: L_k on each corpus's held-out documents, and the blend's sum_k w_k L_k
    row = straight[-1]
    assert set(row) >= {"val_loss", "val_loss/web", "val_loss/code"}
    assert row["val_loss"] == pytest.approx(0.7 * row["val_loss/web"] + 0.3 * row["val_loss/code"], rel=1e-12)
    assert abs(row["val_loss/web"] - row["val_loss/code"]) > 1e-3
    reader = Checkpointer(then, data=data.identity)
    final = reader.restore(4, trainer).params
    reader.close()
    for name in ("web", "code"):
        held = GPTDataset(IndexedDataset(corpora[name]), whole.model.seq_len, whole.data.seed, "valid", 0.1)
        batch = trainer.put_batch(BatchLoader(held, whole.train.global_batch).next_batch())
        assert float(trainer.eval_step(final, batch)) == pytest.approx(resumed[-1][f"val_loss/{name}"], rel=1e-6)

    # other weights: refused on resume, in one line naming data.path, unless allowed
    other = blend_config(corpora, tmp_path / "cut", weights=(0.5, 0.5), extra=["train.steps=6"])
    ck = Checkpointer(other, data=build_datasets(other).identity)
    try:
        with pytest.raises(ConfigError, match=r"^data\.path: checkpoint step 4 was trained on other data: it was "
                                              r"trained with the blend weights 0\.7 0\.3, this run's are 0\.5 0\.5"):
            ck.restore(4, trainer)
        allowed = blend_config(corpora, tmp_path / "cut", weights=(0.5, 0.5), extra=["data.allow_change=true"])
        ck.close()
        ck = Checkpointer(allowed, data=build_datasets(allowed).identity)
        assert int(ck.restore(4, trainer).step) == 4
    finally:
        ck.close()


def test_a_validation_blend_replaces_the_held_out_fraction(corpora, tmp_path):
    cfg = blend_config(corpora, tmp_path, extra=[f"data.valid_path=[{{weight: 3, path: {corpora['code']}}}, "
                                                 f"{{weight: 1, path: {corpora['web']}}}]"])
    with pytest.raises(ConfigError, match="data.valid_fraction: .*no effect"):     # blend_config sets 0.1
        validate(cfg, 1)
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, valid_fraction=DataConfig.valid_fraction))
    assert validate(cfg, 1) == (1, 1, 1)
    data = build_datasets(cfg)
    assert data.identity["valid_fraction"] == 0.0 and data.identity["weights"] == pytest.approx([0.7, 0.3], abs=1e-8)
    assert [(v.name, v.weight) for v in data.valid] == [("code", 0.75), ("web", 0.25)]
    n_web = len(IndexedDataset(corpora["web"]))
    assert sorted(data.valid[1].dataset.doc_ids.tolist()) == list(range(n_web))     # every document
    assert sorted(data.corpora[0].doc_ids.tolist()) == list(range(n_web))            # none held out of training


def in_process_cli(argv, capsys):
    """`python -m mtjax.train ARGV` through its own entry point: (exit status, stderr lines)."""
    from mtjax import train as train_cli
    with pytest.raises(SystemExit) as e:
        cli.run(train_cli.main, argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


BAD = [  # (data.path or an override list, the key the line starts with, a phrase of it)
    ("[]", "data.path", "the weighted list is empty"),
    ("0.7 {web} 0 {code}", "data.path[2].weight", "must be positive and finite, got '0'"),
    ("0.7 {web} -1 {code}", "data.path[2].weight", "must be positive and finite"),
    ("[{{weight: .inf, path: {web}}}]", "data.path[1].weight", "must be positive and finite, got inf"),
    ("0.7 {web} 0.3", "data.path", "weight-prefix pairs"),
    ("0.7 {web} 0.3 {root}/missing", "data.path[2]", "missing data file {root}/missing.bin"),
    ("0.7 {web} 0.3 {tiny}", "data.path[2]", "{tiny}.idx: the train split has"),
]


@pytest.mark.parametrize("path,key,phrase", BAD, ids=[b[1] + "-" + b[2][:12] for b in BAD])
def test_each_bad_blend_is_one_line_exit_2_and_writes_nothing(corpora, tmp_path, capsys, path, key, phrase):
    fill = {k: v for k, v in corpora.items()}
    before = snapshot(tmp_path)
    status, err = in_process_cli(["--config", TINY, f"data.path={path.format(**fill)}", f"train.run_dir={tmp_path}/run",
                                  f"data.cache_dir={tmp_path}/cache", "model.seq_len=64", "train.global_batch=8",
                                  "train.micro_batch=1"], capsys)
    assert status == 2 and len(err) == 1 and err[0].startswith(f"error: {key}: "), err
    assert phrase.format(**fill) in err[0]
    assert snapshot(tmp_path) == before


def test_a_corpus_of_another_tokenization_is_refused_naming_its_file(corpora, tmp_path, capsys):
    other = tmp_path / "other"
    made = {**record(ByteTokenizer(), False), "tokenizer": {"name": "tokenizer.json", "bytes": 1, "crc32": "2"}}
    with IndexedWriter(str(other), np.uint16, made) as w:
        w.add_document([1, 2, 3, 256] * 40)
    status, err = in_process_cli(["--config", TINY, f"data.path=0.5 {corpora['web']} 0.5 {other}",
                                  f"train.run_dir={tmp_path}/run", "train.global_batch=8", "train.micro_batch=1"],
                                 capsys)
    assert status == 2 and len(err) == 1 and err[0].startswith("error: data.tokenizer: "), err
    assert f"{other}.idx was made with the tokenizer" in err[0]
    assert not (tmp_path / "run").exists()


def test_weights_whose_sum_overflows_are_refused():
    """Each weight finite but their sum not: normalised, every share was 0 (quantised to equal
    shares for training, 0 for the validation blend) instead of the ratios given."""
    with pytest.raises(ConfigError, match=r"^data.path: the weights sum to more than a float holds"):
        load_config(None, ["data.path=1e308 a/web 1e308 code"])
    assert load_config(None, ["data.path=1e307 a/web 1e307 code"]).data.path[0].weight == 1e307


def test_the_config_round_trips_a_blend():
    cfg = load_config(None, ["data.path=0.7 a/web 0.3 code"])
    assert cfg.data.path == (Corpus(0.7, "a/web"), Corpus(0.3, "code"))
    from mtjax.config import from_dict
    assert from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg          # as a checkpoint stores it
    assert load_config(None, ["data.path=my data/web"]).data.path == "my data/web"   # one prefix, spaces and all


def test_a_listed_entry_reads_its_numbers_as_the_string_form_does(tmp_path):
    """YAML 1.1 read `weight: 010` as octal 8 and `1:30` as 90 silently, and `path: 007` as the
    int 7 (refused as no prefix), where "010 a 1 007" gives ten and the prefix 007."""
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  path:\n    - {weight: 010, path: a}\n    - {weight: 1, path: 007}\n")
    assert load_config(str(path)).data.path == load_config(None, ["data.path=010 a 1 007"]).data.path \
        == (Corpus(10.0, "a"), Corpus(1.0, "007"))
    with pytest.raises(ConfigError, match=r"^data.path\[1\].weight: expected a number, got '1:30'$"):
        load_config(None, ["data.path=[{weight: 1:30, path: a}]"])
    with pytest.raises(ConfigError, match=r"^data.path\[1\]: expected a mapping \{weight, path\}, got 1$"):
        load_config(None, ["data.path=[1, a]"])
