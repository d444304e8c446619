"""Fine-tuning data: `preprocess --format sft`, rows packed without splitting a sample, the loss
on responses only, and the refusals (one line, exit 2, nothing written). No compiled step here:
the step's side of the loss mask is tests/test_packed.py's."""
import json
import os

import numpy as np
import pytest

from mtjax.commands.preprocess import main as preprocess_main
from mtjax.config import load_config
from mtjax.config.errors import ConfigError
from mtjax.data import sample_index as si
from mtjax.data.errors import DataError
from mtjax.data.indexed import IndexedDataset
from mtjax.data.packed_dataset import PackedDataset, pack_best_fit
from mtjax.data.sft import NO_LOSS, is_sft
from mtjax.training.data_setup import build_datasets

EOD = 256          # the byte tokenizer's
SEQ = 16


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


SAMPLES = [{"prompt": "ab", "response": "cde"}, {"prompt": "", "response": "f"},
           {"prompt": "ghij", "response": "klmnopqrstuvwxyz0123"},        # 25 tokens: cut to 17
           {"prompt": "q", "response": "rs"}, {"prompt": "tuv", "response": "w"}]


@pytest.fixture(scope="module")
def sft_prefix(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    source = write_jsonl(root / "s.jsonl", [{"question": s["prompt"], "answer": s["response"]} for s in SAMPLES])
    prefix = str(root / "sft")
    assert preprocess_main(["--format", "sft", "--input", source, "--output", prefix, "--prompt-key", "question",
                            "--response-key", "answer", "--seq-len", str(SEQ)]) == 0
    return prefix


def test_samples_are_document_pairs(sft_prefix, capsys):
    data = IndexedDataset(sft_prefix)
    assert is_sft(data.record) and data.record["sft"] == {"seq_len": SEQ}
    assert len(data) == 2 * len(SAMPLES)
    assert bytes(data.doc(0).tolist()) == b"ab" and data.doc(1).tolist() == list(b"cde") + [EOD]
    assert len(data.doc(2)) == 0 and data.doc(3).tolist() == [ord("f"), EOD]
    assert len(data.doc(4)) + len(data.doc(5)) == SEQ + 1 and data.doc(5)[-1] != EOD   # truncated, no EOD


def test_rows_pack_whole_samples_with_loss_on_responses(sft_prefix):
    data = IndexedDataset(sft_prefix)
    packed = PackedDataset(data, SEQ, seed=0, eod=EOD)
    seen = []
    for r in range(len(packed)):
        row = packed.row(r)
        assert row.shape == (SEQ + 1,) and row.dtype == np.int32
        at = 0
        for k in packed.samples[packed.bounds[r]:packed.bounds[r + 1]]:
            prompt, response = data.doc(2 * k), data.doc(2 * k + 1)
            assert (row[at:at + len(prompt)] == (prompt.astype(np.int32) | NO_LOSS)).all()          # no loss on the prompt
            at += len(prompt)
            assert (row[at:at + len(response)] == response).all()                   # loss on the response
            at += len(response)
            seen.append(int(k))
        assert (row[at:] == (EOD | NO_LOSS)).all()                                  # padding: no loss
    assert sorted(seen) == list(range(len(SAMPLES)))
    assert packed.padding == len(packed) * (SEQ + 1) - int(data.doc_lengths.sum())
    assert len(PackedDataset(data, SEQ, 0, EOD)) < len(SAMPLES)                     # several to a row


def test_rows_of_an_epoch_share_one_shuffle(sft_prefix, monkeypatch):
    """Reading rows shuffles the row order once per epoch, not once per row (a permutation of
    every row for each row read made a batch cost O(B x rows)); the rows read are the same."""
    from mtjax.data import packed_dataset
    packed = PackedDataset(IndexedDataset(sft_prefix), SEQ, seed=0, eod=EOD)
    n = len(packed)
    expected = [packed.row(int(r)) for e in range(2) for r in si.sample_order(n, 0, "train", e)]
    calls = []
    original = packed_dataset.si.sample_order
    monkeypatch.setattr(packed_dataset.si, "sample_order", lambda *a: calls.append(a) or original(*a))
    got = [packed[i] for i in range(2 * n)]
    assert all((a == b).all() for a, b in zip(got, expected)) and len(calls) == 2


def test_a_train_split_emptied_by_the_held_out_fraction_says_so(tmp_path):
    prefix = str(tmp_path / "one")
    assert preprocess_main(["--format", "sft", "--input", write_jsonl(tmp_path / "one.jsonl", SAMPLES[:1]),
                            "--output", prefix, "--seq-len", str(SEQ)]) == 0
    why = r"the train split has no samples \(valid_fraction 0.02 holds out 1 of its 1\)"   # was: no samples, no why
    with pytest.raises(DataError, match=why):
        PackedDataset(IndexedDataset(prefix), SEQ, 0, EOD, "train", 0.02)


def test_best_fit_keeps_order_within_rows():
    order, bounds = pack_best_fit(np.array([5, 9, 4, 6, 1]), 10)
    rows = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    assert rows == [[0, 2, 4], [1], [3]]       # 4 goes in the row of 5 left, 1 then in the fullest


def test_a_longer_sample_than_the_model_takes_is_refused(sft_prefix):
    with pytest.raises(DataError, match="more than model.seq_len"):
        PackedDataset(IndexedDataset(sft_prefix), SEQ // 2, 0, EOD)


def test_a_cut_sample_takes_a_row_of_its_own_under_a_longer_model_sequence(sft_prefix):
    """Data made for s = 16 read by a model of s = 32: the cut sample (no EOD) is followed only by
    padding, so under document masking no other sample joins its document."""
    data = IndexedDataset(sft_prefix)
    packed = PackedDataset(data, 2 * SEQ, 0, EOD)
    cut = [k for k in range(len(SAMPLES)) if data.doc(2 * k + 1)[-1] != EOD]
    assert cut == [2]
    for r in range(len(packed)):
        members = packed.samples[packed.bounds[r]:packed.bounds[r + 1]].tolist()
        if 2 in members:
            assert members == [2]
            row = packed.row(r)
            assert (row[SEQ + 1:] == (EOD | NO_LOSS)).all()
    assert packed.padding == len(packed) * (2 * SEQ + 1) - int(data.doc_lengths.sum())
    assert len(packed) < len(SAMPLES)                                                # the others still share


def test_an_odd_count_of_documents_is_refused(tmp_path):
    from mtjax.data import ByteTokenizer, IndexedWriter
    from mtjax.data.tokenizer import record
    prefix = str(tmp_path / "odd")
    with IndexedWriter(prefix, np.uint16, {**record(ByteTokenizer(), False), "sft": {"seq_len": SEQ}}) as w:
        for doc in ([1, 2], [3, EOD], [4]):
            w.add_document(doc)
    with pytest.raises(DataError, match="3 documents, an odd count"):
        PackedDataset(IndexedDataset(prefix), SEQ, 0, EOD)


def test_training_needs_document_masking(sft_prefix, tmp_path):
    cfg = load_config(None, [f"data.path={sft_prefix}", f"model.seq_len={SEQ}", f"data.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="data.document_masking"):
        build_datasets(cfg)
    data = build_datasets(load_config(None, [f"data.path={sft_prefix}", f"model.seq_len={SEQ}",
                                             "data.document_masking=true", "data.valid_fraction=0.2"]))
    assert isinstance(data.train, PackedDataset) and data.eod == EOD
    assert isinstance(data.valid[0].dataset, PackedDataset)


BAD = [  # (line, what the one error line says)
    ('["a list"]', "expected a JSON object, got an array"),
    ('{"prompt": null, "response": "b"}', "'prompt' is null, not a string"),
    ('{"prompt": "a"}', "no key 'response'"),
    ('{"prompt": 3, "response": "b"}', "'prompt' is a number, not a string"),
    ('{"prompt": "a", "response": ""}', "the response is empty"),
    (json.dumps({"prompt": "x" * SEQ, "response": "b"}), "fills the whole sequence"),
]


@pytest.mark.parametrize("line,fragment", BAD)
def test_bad_samples_exit_2_and_write_nothing(tmp_path, capsys, line, fragment):
    source = write_jsonl(tmp_path / "in.jsonl", [SAMPLES[0], line])
    before = sorted(os.listdir(tmp_path))
    status = preprocess_main(["--format", "sft", "--input", source, "--output", str(tmp_path / "out"),
                              "--seq-len", str(SEQ)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0] and "in.jsonl:2" in err[0], err
    assert sorted(os.listdir(tmp_path)) == before


def test_the_library_refuses_add_bos_without_a_bos_token_before_reading(tmp_path):
    """`preprocess_sft` called directly (not through the command, whose tokenizer loading refuses
    first) names add_bos, as `build_index.preprocess` does, and writes nothing."""
    from mtjax.data.sft import preprocess_sft
    from mtjax.data.tokenizer import ByteTokenizer
    source = write_jsonl(tmp_path / "in.jsonl", SAMPLES)
    with pytest.raises(DataError, match="has no beginning-of-document token") as e:
        preprocess_sft([source], str(tmp_path / "out"), ByteTokenizer(), SEQ, add_bos=True)
    assert e.value.option == "add_bos" and sorted(os.listdir(tmp_path)) == ["in.jsonl"]
