"""The preprocess command's refusals beyond test_data.py's: a BOS that is the EOD id, a flag left
without effect, a leftover index. Each is one line, exit status 2, and nothing written; in
process, through the command's own entry point."""
import json

import numpy as np
import pytest

from test_data import all_paths
from tokenizer_fixture import FIXTURE
from mtjax.commands.preprocess import main as preprocess_main
from mtjax.data import IndexedDataset
from mtjax.model.documents import find_documents

BOS, EOD = 0, 1                      # the fixture tokenizer's <|begin_of_text|>, <|end_of_text|>


def run(argv, capsys):
    """(exit status, stderr lines) of `python -m mtjax.data.preprocess ARGV`."""
    try:
        status = preprocess_main(argv)
    except SystemExit as e:          # argparse's errors exit from inside parse_args
        status = e.code
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def docs(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [
        {"text": "the cat", "prompt": "the", "response": "cat"}, {"text": "a dog", "prompt": "a", "response": "dog"}]))
    return str(path)


BOS_IS_EOD = {   # flags that make the beginning-of-document token the end-of-document one
    "bos_named_eod": (["--bos-token", "<|end_of_text|>"], "'<|end_of_text|>' is also the end-of-document token (id 1)"),
    "eod_named_bos": (["--eod-token", "<|begin_of_text|>"], "'<|begin_of_text|>' is also the end-of-document token "
                                                            "(id 0)"),
    "sft": (["--format", "sft", "--bos-token", "<|end_of_text|>"], "is also the end-of-document token (id 1)"),
}


@pytest.mark.parametrize("case", BOS_IS_EOD)
def test_add_bos_with_the_eod_token_is_refused(tmp_path, capsys, docs, case):
    """Such a BOS would read as the end of the document before it: --add-bos is refused, naming it."""
    flags, fragment = BOS_IS_EOD[case]
    before = all_paths(tmp_path)
    status, err = run(["--input", docs, "--output", str(tmp_path / "out"), "--tokenizer", FIXTURE, "--add-bos",
                       *flags], capsys)
    assert status == 2 and len(err) == 1 and err[0].startswith("error: --add-bos: the beginning-of-document token "), err
    assert fragment in err[0] and "leave BOS out" in err[0]
    assert all_paths(tmp_path) == before


def test_a_bos_equal_to_eod_would_begin_no_document():
    """Why: the documents of a row are read off its EOD tokens, so in `BOS doc EOD BOS doc EOD` each
    BOS (= EOD) is a document of one token and each text starts a document after it, at position 0."""
    row = np.array([[EOD, 7, 8, EOD, EOD, 9, 10, EOD]])
    docs = find_documents(row, EOD)
    assert np.asarray(docs.segments).tolist() == [[0, 1, 1, 1, 2, 3, 3, 3]]
    assert np.asarray(docs.positions).tolist() == [[0, 0, 1, 2, 0, 0, 1, 2]]


def test_a_distinct_bos_still_begins_every_document(tmp_path, capsys, docs):
    status, err = run(["--input", docs, "--output", str(tmp_path / "out"), "--tokenizer", FIXTURE, "--add-bos"],
                      capsys)
    assert status == 0, err
    data = IndexedDataset(str(tmp_path / "out"))
    assert [data.doc(i).tolist()[::len(data.doc(i)) - 1] for i in range(len(data))] == [[BOS, EOD]] * 2


def test_bos_token_without_add_bos_is_refused(tmp_path, capsys, docs):
    before = all_paths(tmp_path)
    status, err = run(["--input", docs, "--output", str(tmp_path / "out"), "--tokenizer", FIXTURE,
                       "--bos-token", "<|begin_of_text|>"], capsys)
    assert status == 2 and err == ["error: --bos-token: applies with --add-bos only: here it would have no effect"]
    assert all_paths(tmp_path) == before


def test_a_leftover_index_alone_is_refused_and_kept(tmp_path, capsys, docs):
    """An .idx with no .bin beside it (test_cli_inputs.py has both there) is replaced by nothing either."""
    (tmp_path / "out.idx").write_bytes(b"kept")
    before = all_paths(tmp_path)
    status, err = run(["--input", docs, "--output", str(tmp_path / "out")], capsys)
    assert status == 2 and err == [f"error: --output: {tmp_path / 'out'}.idx already exists; choose another prefix"]
    assert all_paths(tmp_path) == before and (tmp_path / "out.idx").read_bytes() == b"kept"
