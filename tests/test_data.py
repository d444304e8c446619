"""Tests for mtjax.data: tokenize -> indexed files -> GPT samples -> batches.

Expected values are recomputed from the inputs (the texts, the token stream),
never pasted. Each dataset is small; the stdlib corpus is built once per session.
"""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from mtjax.commands.preprocess import main as preprocess_main
from mtjax.data import (BatchLoader, ByteTokenizer, DataError, GPTDataset, IndexedDataset,
                        IndexedWriter, default_corpus, host_slice, load_tokenizer)
from mtjax.data import indexed as indexed_mod
from mtjax.data import tempfiles
from mtjax.data.build_index import preprocess
from mtjax.data.corpus import stdlib_sources
from mtjax.interrupts import Interrupted

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello, world.", "", "naïve café — 東京\nsecond line\n", "x" * 300, '{"not": "json text"}']
NONEMPTY = [t for t in TEXTS if t]  # preprocess skips documents without text
EOD = ByteTokenizer.EOD_TEXT


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t, "other": 1}) + "\n")
    return str(path)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mtjax.data.preprocess", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def write_dataset(prefix, docs, dtype=np.uint16):
    with IndexedWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def tmp_files(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def wait_for(condition, proc, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def unique_token_docs(lengths):
    """Documents whose tokens are their global positions: every token is unique."""
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(len(lengths))]


@pytest.fixture
def stream_data(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 40, size=60)
    lengths[[7, 8, 30]] = 0  # empty documents must be stepped over
    return IndexedDataset(write_dataset(tmp_path / "s", unique_token_docs(lengths), np.uint32))


# ----------------------------------------------------------------- tokenizers

def test_byte_tokenizer_roundtrip():
    tok = load_tokenizer("byte")
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and max(ids, default=0) < tok.eod_id < tok.vocab_size
        assert tok.decode(ids + [tok.eod_id] + ids) == text + EOD + text


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    corpus = ["the cat sat on the mat", "the dog ate the cat", "a mat is a mat"]

    def build(specials, name):
        tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
        tok.save(str(tmp_path / name))
        return tok, str(tmp_path / name)

    ref, path = build(["[UNK]", "</s>"], "tok.json")
    tok = load_tokenizer(path)
    assert tok.eod_id == ref.token_to_id("</s>") and tok.vocab_size == ref.get_vocab_size()
    data = write_jsonl(tmp_path / "in.jsonl", corpus)
    stats = preprocess([data], str(tmp_path / "hf"), tok)
    ds = IndexedDataset(str(tmp_path / "hf"))
    assert (len(ds), stats.tokens) == (len(corpus), ds.tokens)
    for i, text in enumerate(corpus):
        assert ds.doc(i).tolist() == ref.encode(text, add_special_tokens=False).ids + [tok.eod_id]
        assert tok.decode(ds.doc(i)) == ref.decode(ds.doc(i).tolist(), skip_special_tokens=False)
    _, no_eod = build(["[UNK]"], "no_eod.json")
    with pytest.raises(DataError, match="no_eod.json"):
        load_tokenizer(no_eod)
    with pytest.raises(DataError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))


# ----------------------------------------------------------------- preprocess

def check_docs(prefix, texts):
    ds, tok = IndexedDataset(prefix), ByteTokenizer()
    assert len(ds) == len(texts) and ds.dtype == np.uint16
    for i, text in enumerate(texts):
        assert ds.doc(i).tolist() == tok.encode(text) + [tok.eod_id]
        assert tok.decode(ds.doc(i)) == text + EOD
    assert ds.tokens == sum(len(t.encode("utf-8")) + 1 for t in texts)


def test_cli_jsonl_roundtrip(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", TEXTS, key="body")
    out = str(tmp_path / "out")
    r = run_cli("--input", data, "--output", out, "--json-key", "body")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and f"{len(NONEMPTY)} documents" in lines[0] and "1 empty" in lines[0]
    check_docs(out, NONEMPTY)


def test_plain_text_files_are_one_document_each(tmp_path):
    paths = []
    for i, text in enumerate(TEXTS[2:]):
        paths.append(str(tmp_path / f"doc{i}.txt"))
        with open(paths[-1], "w", encoding="utf-8", newline="") as f:   # line ends kept as written, \r too
            f.write(text + "\r\n\r\nparagraph two\rthree\n")
    jsonl = write_jsonl(tmp_path / "more.JSONL", TEXTS[:2])     # auto: JSON lines in any case (was one text)
    stats = preprocess(paths + [jsonl], str(tmp_path / "out"), ByteTokenizer())
    expected = [t + "\r\n\r\nparagraph two\rthree\n" for t in TEXTS[2:]] + TEXTS[:1]  # TEXTS[1] is empty
    check_docs(str(tmp_path / "out"), expected)
    assert (stats.documents, stats.skipped) == (len(expected), 1)


def test_malformed_jsonl_cli(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": "ok"}) + "\n\n" + '{"text": "unterminated\n')
    r = run_cli("--input", str(data), "--output", str(tmp_path / "out"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.jsonl:3:" in lines[0], r.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def tiny_hf_tokenizer(path):
    """A word-level tokenizer.json with </s> as EOD, or a skip without the package."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(["a b c"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(path))
    return str(path)


def unwritable_dir(tmp_path):
    """A directory this process cannot create files in (root ignores modes: /sys then)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for candidate in (str(ro), "/sys"):
        try:
            os.close(os.open(os.path.join(candidate, "probe"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except OSError:
            return candidate
        os.remove(os.path.join(candidate, "probe"))
    pytest.skip("no directory here refuses new files")


def bad_cli_case(tmp_path, case):
    """(argv, fragment the error line must hold) for one kind of bad input."""
    good = write_jsonl(tmp_path / "good.jsonl", ["a", "b"])
    out = str(tmp_path / "out")
    args = ["--input", good, "--output", out]
    if case == "missing_key":
        return args + ["--json-key", "nope"], "good.jsonl:1: no key 'nope'"
    if case == "missing_input":
        return ["--input", good, "--input", str(tmp_path / "nope.txt"), "--output", out], "nope.txt: file not found"
    if case == "empty_input_name":
        return ["--input", "", "--output", out], "an --input is empty"
    if case == "input_is_dir":
        return ["--input", str(tmp_path), "--output", out], f"{tmp_path}: is a directory"
    if case == "not_utf8":
        (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
        return ["--input", str(tmp_path / "latin1.txt"), "--output", out], "latin1.txt: not valid UTF-8 (byte 3)"
    if case == "not_utf8_line":
        (tmp_path / "in.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
        return ["--input", str(tmp_path / "in.jsonl"), "--output", out], "in.jsonl:2: not valid UTF-8"
    if case in ("lone_surrogate", "lone_surrogate_hf"):
        (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
        args[1] = str(tmp_path / "in.jsonl")
        if case == "lone_surrogate_hf":
            args += ["--tokenizer", tiny_hf_tokenizer(tmp_path / "tok.json")]
        return args, "in.jsonl:2: 'text' holds a lone surrogate"
    if case == "json_too_deep":
        (tmp_path / "in.jsonl").write_text("[" * 100_000 + "\n")
        return ["--input", str(tmp_path / "in.jsonl"), "--output", out], "in.jsonl:1: malformed JSON"
    if case == "json_huge_int":
        (tmp_path / "in.jsonl").write_text('{"text": "a", "n": ' + "9" * 5000 + "}\n")
        return ["--input", str(tmp_path / "in.jsonl"), "--output", out], "in.jsonl:1: malformed JSON"
    if case in ("no_text_jsonl", "no_text_files"):
        inputs = [write_jsonl(tmp_path / "empty.jsonl", ["", ""])]
        if case == "no_text_files":
            (tmp_path / "blank.jsonl").write_text("\n  \n")
            (tmp_path / "empty.txt").write_text("")
            inputs = [inputs[0], str(tmp_path / "blank.jsonl"), str(tmp_path / "empty.txt")]
        return [a for p in inputs for a in ("--input", p)] + ["--output", out], "no documents: "
    if case == "missing_dir":
        return args[:-1] + [str(tmp_path / "no_dir" / "out")], "no_dir: output directory does not exist"
    if case == "dir_is_file":
        return args[:-1] + [os.path.join(good, "out")], "output directory does not exist or is not"
    if case == "output_is_dir":
        return args[:-1] + [str(tmp_path)], f"{tmp_path}: is a directory"
    if case == "output_ends_with_separator":
        return args[:-1] + [out + os.sep], "ends with a path separator"
    if case == "output_empty":
        return args[:-1] + [""], "output prefix is empty"
    if case in ("bin_is_dir", "idx_is_dir"):
        suffix = "." + case[:3]
        os.mkdir(out + suffix)
        return args, f"out{suffix}: is a directory"
    if case == "output_dir_unwritable":
        return args[:-1] + [os.path.join(unwritable_dir(tmp_path), "out")], "output directory is not writable"
    if case == "unknown_tokenizer":
        return args + ["--tokenizer", str(tmp_path / "nope.json")], "nope.json: tokenizer file not found"
    if case == "tokenizer_is_dir":
        return args + ["--tokenizer", str(tmp_path)], "is a directory, not a tokenizer file"
    if case == "abbreviated_option":
        return ["--input", good, "--out", out], "--output"
    if case == "unknown_option":
        return args + ["--outptu", out], "unrecognized arguments: --outptu"
    if case == "sft_flag_without_sft":
        return args + ["--seq-len", "64"], "--seq-len: applies to --format sft only"
    if case == "json_key_without_jsonl":
        return args + ["--format", "text", "--json-key", "body"], "--json-key: no input is read as JSONL"
    raise AssertionError(case)


BAD_CLI_CASES = [
    "missing_key", "missing_input", "empty_input_name", "input_is_dir", "not_utf8", "not_utf8_line", "lone_surrogate",
    "lone_surrogate_hf", "json_too_deep", "json_huge_int", "no_text_jsonl", "no_text_files", "missing_dir",
    "dir_is_file", "output_is_dir", "output_ends_with_separator", "output_empty", "bin_is_dir",
    "idx_is_dir", "output_dir_unwritable", "unknown_tokenizer", "tokenizer_is_dir", "abbreviated_option",
    "unknown_option", "sft_flag_without_sft", "json_key_without_jsonl",
]


def all_paths(root):
    return sorted(os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files)


@pytest.mark.parametrize("case", BAD_CLI_CASES)
def test_bad_input_exit_2(tmp_path, capsys, case):
    args, fragment = bad_cli_case(tmp_path, case)
    before = all_paths(tmp_path)
    try:
        status = preprocess_main(args)
    except SystemExit as e:  # argparse's errors exit from inside parse_args
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err
    assert all_paths(tmp_path) == before


FULL_DISK = """
import resource, sys
from mtjax.commands.preprocess import main
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # writes past 4 KiB fail (EFBIG), as on a full disk
sys.exit(main(sys.argv[1:]))
"""


def test_preprocess_write_failure_leaves_nothing(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", ["x" * 3000] * 4)
    before = all_paths(tmp_path)
    r = subprocess.run([sys.executable, "-c", FULL_DISK, "--input", data, "--output", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1                     # a fault, not bad input
    assert r.stderr.splitlines() == [f"error: {tmp_path / 'out'}: cannot write the output (File too large); "
                                     "nothing was written"]
    assert all_paths(tmp_path) == before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_preprocess_interrupted_writes_nothing(tmp_path, signum):
    """The input is a pipe that never ends, so the signal surely lands mid-run."""
    fifo = str(tmp_path / "in.jsonl")
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "mtjax.data.preprocess", "--input", fifo,
                             "--output", str(tmp_path / "out")], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        fd = None

        def opened():  # succeeds once preprocess reads the pipe: its temporary .bin exists by then
            nonlocal fd
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                return False
            return True

        wait_for(opened, proc, "preprocess to open its input")
        os.write(fd, json.dumps({"text": "one document"}).encode() + b"\n")
        assert tmp_files(tmp_path)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
        os.close(fd)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum
    assert err.splitlines() == [f"error: interrupted by {signal.Signals(signum).name}; nothing was written"]
    assert os.listdir(tmp_path) == ["in.jsonl"]


# ----------------------------------------------------------------- indexed files

def test_writer_roundtrip_uint32_and_atomicity(tmp_path):
    docs = [np.array([0, 70000, 2**32 - 1]), np.array([], dtype=np.int64), np.array([5])]
    prefix = tmp_path / "big"
    with pytest.raises(RuntimeError):
        with IndexedWriter(str(prefix), np.uint32) as w:
            w.add_document(docs[0])
            raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path) == []
    w = IndexedWriter(str(prefix), np.uint32)
    for d in docs:
        w.add_document(d)
    [tmp] = os.listdir(tmp_path)  # only the .bin's temporary, which names its owner
    assert tmp.startswith(f"big.bin.{socket.gethostname()}.{os.getpid()}.") and tmp.endswith(".tmp")
    w.finalize()
    assert sorted(os.listdir(tmp_path)) == ["big.bin", "big.idx"]
    ds = IndexedDataset(str(prefix))
    assert [ds.doc(i).tolist() for i in range(len(ds))] == [d.tolist() for d in docs]
    assert ds.tokens == sum(map(len, docs)) and ds.dtype == np.uint32
    with pytest.raises(ValueError):
        IndexedWriter(str(tmp_path / "small"), np.uint16).add_document([70000])


def test_a_huge_document_costs_a_few_bytes_a_token(tmp_path):
    """One document of n tokens (a text file) peaked at 29 bytes a token of Python allocations
    (the id list, a second list with EOD, an int64 copy, the uint16 array and its bytes); the
    list is now converted in pieces into the token dtype: 13.5. The ids are those of the text,
    and a bad id in a late piece still writes nothing of its document."""
    import tracemalloc
    n = 1 << 22
    text = "ab\u00e9" * (n // 4)                                 # 4 bytes: 'a', 'b', 2 of the e
    (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
    tracemalloc.start()
    try:
        preprocess([str(tmp_path / "doc.txt")], str(tmp_path / "out"), ByteTokenizer())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * n, peak / n
    assert IndexedDataset(str(tmp_path / "out")).doc(0).tolist() == list(text.encode()) + [256]
    with IndexedWriter(str(tmp_path / "w"), np.uint16) as w:
        with pytest.raises(ValueError, match="token ids must be integers"):
            w.add_document([1] * (1 << 18) + [70000])
        assert (w.tokens, w.documents) == (0, 0)
        w.add_document([3, 4])
    assert IndexedDataset(str(tmp_path / "w")).doc(0).tolist() == [3, 4]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, Interrupted])
def test_writer_base_exception_leaves_nothing(tmp_path, exc):
    with pytest.raises(exc):
        with IndexedWriter(str(tmp_path / "d"), np.uint16) as w:
            w.add_document([1, 2, 3])
            raise exc(signal.SIGTERM) if exc is Interrupted else exc()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("renames_before_signal", [0, 1, 2])
def test_interrupted_inside_finalize_leaves_nothing(tmp_path, monkeypatch, renames_before_signal):
    """The signal lands before, between or just after the two renames into place."""
    real_replace, done = os.replace, []

    def replace(src, dst):
        if len(done) == renames_before_signal:
            raise Interrupted(signal.SIGTERM)
        real_replace(src, dst)
        done.append(dst)
        if len(done) == renames_before_signal == 2:
            raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(indexed_mod.os, "replace", replace)
    with pytest.raises(Interrupted):
        with IndexedWriter(str(tmp_path / "d"), np.uint16) as w:
            w.add_document([1, 2, 3])
    assert len(done) == renames_before_signal and os.listdir(tmp_path) == []


def test_finalize_onto_a_directory_leaves_nothing(tmp_path):
    (tmp_path / "d.idx").mkdir()
    with pytest.raises(IsADirectoryError):
        with IndexedWriter(str(tmp_path / "d"), np.uint16) as w:
            w.add_document([1, 2, 3])
    assert os.listdir(tmp_path) == ["d.idx"]  # the .bin renamed before the failure is taken back


KILL_WRITER = """
import sys, time
from mtjax.data.indexed import IndexedWriter
w = IndexedWriter(sys.argv[1], "uint16")
w.add_document([1, 2, 3])
print("ready", flush=True)
time.sleep(60)
"""


def test_stale_temporaries_are_swept(tmp_path):
    prefix = str(tmp_path / "d")
    proc = subprocess.Popen([sys.executable, "-c", KILL_WRITER, prefix], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()
        proc.wait()
    [stale] = tmp_files(tmp_path)
    assert f".{proc.pid}." in stale  # SIGKILL ran no cleanup
    token = "0" * tempfiles.TOKEN_HEX_DIGITS
    keep = [f"d.bin.{socket.gethostname()}.{os.getpid()}.{token}.tmp",  # a live writer
            f"d.bin.some-other-host.{proc.pid}.{token}.tmp",  # another host: cannot tell
            f"e.bin.{socket.gethostname()}.{proc.pid}.{token}.tmp"]  # another prefix
    for name in keep:
        (tmp_path / name).write_bytes(b"")
    IndexedWriter(prefix, np.uint16).abort()
    assert tmp_files(tmp_path) == sorted(keep)


def test_index_header_records_max_id_and_crcs(tmp_path):
    prefix = write_dataset(tmp_path / "d", unique_token_docs([5, 7, 3, 9]))
    raw = open(prefix + ".idx", "rb").read()
    magic, version, code, n_docs, tokens, max_id, bin_crc, record_len, idx_crc = indexed_mod.HEADER.unpack_from(raw)
    assert (magic, version, code, n_docs, tokens, max_id) == (b"MTJAXIDX", 3, 1, 4, 24, 23)
    assert bin_crc == zlib.crc32(open(prefix + ".bin", "rb").read())
    at = indexed_mod.HEADER.size - 8
    assert idx_crc == zlib.crc32(raw[:at] + bytes(4) + raw[at + 4:])
    assert record_len % 8 == 0 and json.loads(raw[indexed_mod.HEADER.size:][:record_len]) == {}
    assert len(raw) == indexed_mod.HEADER.size + record_len + 8 * (n_docs + 1)


def test_index_records_the_tokenization(tmp_path):
    """The record goes into the .idx, under its CRC; the fingerprint covers only the tokens and
    their documents (it is the one a version-2 index of the same data had)."""
    docs = unique_token_docs([5, 7, 3])
    record = {"tokenizer": {"name": "byte"}, "vocab_size": 257, "eod_id": 256, "bos_id": None, "add_bos": False}
    with IndexedWriter(str(tmp_path / "r"), np.uint16, record) as w:
        for d in docs:
            w.add_document(d)
    plain, recorded = IndexedDataset(write_dataset(tmp_path / "p", docs)), IndexedDataset(str(tmp_path / "r"))
    assert recorded.record == record and plain.record is None
    assert recorded.fingerprint == plain.fingerprint
    offsets = plain.offsets.astype("<i8").tobytes()
    v2 = struct.pack("<8sIIQQqII", b"MTJAXIDX", 2, 1, 3, 15, 14, plain.bin_crc32, 0) + offsets
    assert plain.fingerprint == f"{zlib.crc32(v2):08x}-{len(v2)}"


@pytest.mark.parametrize("dtype, docs", [
    (np.uint16, [[3, 65535, 0], [], [7]]),
    (np.uint32, [[70000, 5], [2**32 - 1]]),
    (np.uint32, [[], []]),
])
def test_max_token_id(tmp_path, dtype, docs):
    prefix = write_dataset(tmp_path / "d", [np.array(d, dtype=np.int64) for d in docs], dtype)
    expected = max((t for d in docs for t in d), default=-1)
    for verify in (True, False):
        assert IndexedDataset(prefix, verify=verify).max_token_id == expected


def test_max_id_checked_against_the_tokens(tmp_path):
    """An index sealed with a wrong max_id (a writer's bug) is caught by the verifying pass."""
    prefix = write_dataset(tmp_path / "d", unique_token_docs([5, 7]))
    ds = IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(indexed_mod.encode_index(ds.dtype, ds.offsets, ds.max_token_id - 1, ds.bin_crc32))
    with pytest.raises(DataError, match="largest token id 11 differs") as e:
        IndexedDataset(prefix)
    assert str(e.value).startswith(prefix + ".bin:")
    assert IndexedDataset(prefix, verify=False).max_token_id == 10  # the header is all it reads


def flip_bit(path, byte, bit=0):
    raw = bytearray(open(path, "rb").read())
    raw[byte] ^= 1 << bit
    open(path, "wb").write(bytes(raw))


HEADER_FIELDS = {  # byte offset of each field of the v3 header
    "dtype": 12, "n_docs": 16, "tokens": 24, "max_id": 32, "bin_crc": 40, "record_len": 44, "idx_crc": 48,
    "record": 56,
}


@pytest.mark.parametrize("where", [*HEADER_FIELDS, "offsets"])
def test_flipped_index_bit_reported_against_the_index(tmp_path, where):
    prefix = write_dataset(tmp_path / "d", unique_token_docs([5, 7, 3, 9]))
    byte = os.path.getsize(prefix + ".idx") - 8 * 3 if where == "offsets" else HEADER_FIELDS[where]
    flip_bit(prefix + ".idx", byte)
    for verify in (True, False):
        with pytest.raises(DataError, match="index checksum mismatch.*corrupted") as e:
            IndexedDataset(prefix, verify=verify)
        assert str(e.value).startswith(prefix + ".idx:") and "\n" not in str(e.value)


def test_every_flipped_bit_is_reported_against_its_file(tmp_path):
    prefix = write_dataset(tmp_path / "d", unique_token_docs([5, 7, 3, 9]))
    for suffix in (".idx", ".bin"):
        path = prefix + suffix
        for byte in range(os.path.getsize(path)):
            bit = byte % 8  # every byte, each bit position (all 8 x 136 cases take seconds)
            flip_bit(path, byte, bit)
            with pytest.raises(DataError) as e:
                IndexedDataset(prefix)
            assert str(e.value).startswith(path + ":"), (byte, bit, str(e.value))
            flip_bit(path, byte, bit)
    IndexedDataset(prefix)


def test_version_2_refused(tmp_path):
    """Version 2 has no tokenizer record: nothing says which tokenizer made the tokens."""
    prefix = write_dataset(tmp_path / "d", unique_token_docs([2, 4]))
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[8:12] = struct.pack("<I", 2)
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(DataError, match=r"version 2 does not record which tokenizer .*mtjax\.data\.preprocess") as e:
        IndexedDataset(prefix)
    assert str(e.value).startswith(prefix + ".idx:") and "\n" not in str(e.value)


def test_version_1_refused(tmp_path):
    prefix = str(tmp_path / "old")
    tokens = np.arange(6, dtype="<u2")
    tokens.tofile(prefix + ".bin")
    header_v1 = struct.Struct("<8sIIQQI4x")  # magic, version, dtype, n_docs, tokens, bin crc
    offsets = np.array([0, 2, 6], dtype="<i8")
    with open(prefix + ".idx", "wb") as f:
        f.write(header_v1.pack(b"MTJAXIDX", 1, 1, 2, 6, zlib.crc32(tokens.tobytes())) + offsets.tobytes())
    with pytest.raises(DataError, match=r"version 1 .*python -m mtjax\.data\.preprocess") as e:
        IndexedDataset(prefix)
    assert str(e.value).startswith(prefix + ".idx:") and "\n" not in str(e.value)


def _resealed_non_monotonic(raw):
    header = indexed_mod.HEADER.unpack_from(raw)
    offsets = np.frombuffer(raw, dtype="<i8", offset=indexed_mod.HEADER.size + header[7]).copy()
    offsets[2] = offsets[1] - 1
    return indexed_mod.encode_index(np.uint16, offsets, header[5], header[6])


CORRUPTIONS = {  # name -> (file suffix, new contents from old contents, message fragment)
    "truncated_bin": (".bin", lambda b: b[:-2], "truncated"),
    "truncated_idx": (".idx", lambda b: b[:-8], "truncated"),
    "truncated_header": (".idx", lambda b: b[:10], "truncated"),
    "extended_idx": (".idx", lambda b: b + bytes(8), "checksum"),
    "flipped_bin_byte": (".bin", lambda b: b[:7] + bytes([b[7] ^ 0x40]) + b[8:], "crc32"),
    "bad_magic": (".idx", lambda b: b"NOTMAGIC" + b[8:], "magic"),
    "bad_version": (".idx", lambda b: b[:8] + struct.pack("<I", 99) + b[12:], "version 99"),
    "offsets_not_monotonic_resealed": (".idx", _resealed_non_monotonic, "monoton"),
    "missing_bin": (".bin", "delete", "not found"),
    "missing_idx": (".idx", "delete", "not found"),
    "bin_is_dir": (".bin", "mkdir", "directory"),
    "idx_is_dir": (".idx", "mkdir", "directory"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corruption_detected(tmp_path, name):
    prefix = write_dataset(tmp_path / "d", unique_token_docs([5, 7, 3, 9]))
    IndexedDataset(prefix)  # intact data opens
    suffix, change, fragment = CORRUPTIONS[name]
    path = prefix + suffix
    if change in ("delete", "mkdir"):
        os.remove(path)
        if change == "mkdir":
            os.mkdir(path)
    else:
        new = change(open(path, "rb").read())
        open(path, "wb").write(new)
    with pytest.raises(DataError, match=fragment) as e:
        IndexedDataset(prefix)
    message = str(e.value)
    assert message.startswith(path + ":") and "\n" not in message
    if name == "flipped_bin_byte":
        assert IndexedDataset(prefix, verify=False).tokens == 24  # only the crc catches it


# ----------------------------------------------------------------- GPT samples

def test_samples_are_windows_of_the_shuffled_stream(stream_data):
    seq_len = 16
    ds = GPTDataset(stream_data, seq_len, seed=3, split="train", valid_fraction=0.1)
    assert sorted(ds.doc_ids.tolist()) != ds.doc_ids.tolist()  # documents are shuffled
    stream = np.concatenate([stream_data.doc(int(d)) for d in ds.doc_ids])
    assert len(ds) == (len(stream) - 1) // seq_len
    start_doc_len = stream_data.doc_lengths[ds.doc_ids[ds.start_doc]]
    assert np.all((0 <= ds.start_offset) & (ds.start_offset < start_doc_len))  # no wasted doc reads
    orders = []
    for epoch in range(2):
        starts = []
        for k in range(len(ds)):
            sample = ds[epoch * len(ds) + k]
            assert sample.dtype == np.int32 and sample.shape == (seq_len + 1,)
            start = int(np.flatnonzero(stream == sample[0])[0])  # tokens are unique
            np.testing.assert_array_equal(sample, stream[start:start + seq_len + 1])
            starts.append(start)
        assert sorted(starts) == list(range(0, len(ds) * seq_len, seq_len))  # each window once
        orders.append(starts)
    assert orders[0] != orders[1] and orders[0] != sorted(orders[0])


def test_sample_index_deterministic_and_cached(stream_data, tmp_path):
    def build(seed=3, cache=None, data=stream_data):
        return GPTDataset(data, 16, seed=seed, split="train", valid_fraction=0.1, cache_dir=cache)

    def arrays(ds):
        return [ds.doc_ids, ds.start_doc, ds.start_offset, ds.sample_order(0), ds.sample_order(1)]

    a, b = build(), build()
    for x, y in zip(arrays(a), arrays(b)):
        np.testing.assert_array_equal(x, y)
    cache = str(tmp_path / "cache")
    first = build(cache=cache)
    first.save_cache()
    again = build(cache=cache)
    assert not first.loaded_from_cache and again.loaded_from_cache and os.path.isfile(again.cache_path)
    for x, y in zip(arrays(a), arrays(again)):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(build(seed=4).doc_ids, a.doc_ids)
    other = IndexedDataset(write_dataset(tmp_path / "other", unique_token_docs([50] * 10)))
    assert not build(cache=cache, data=other).loaded_from_cache  # new data, new cache key


def reference_arrays(data, seq_len=16):
    ds = GPTDataset(data, seq_len, seed=3, split="train", valid_fraction=0.1)
    return ds.doc_ids, ds.start_doc, ds.start_offset


def save_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _damage(path, kind, ref):
    doc_ids, start_doc, start_offset = ref
    fields = {"doc_ids": doc_ids, "start_doc": start_doc, "start_offset": start_offset}
    if kind == "truncated":
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[:len(raw) // 2])
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "random_bytes":
        open(path, "wb").write(np.random.default_rng(0).bytes(500))
    elif kind == "directory":
        os.remove(path)
        os.mkdir(path)
    elif kind == "pickled_objects":
        save_npz(path, **{**fields, "doc_ids": np.array([object()] * len(doc_ids))})
    elif kind == "missing_array":
        save_npz(path, doc_ids=doc_ids, start_doc=start_doc)
    elif kind == "wrong_shape":
        save_npz(path, **{**fields, "start_doc": start_doc.reshape(1, -1)})
    elif kind == "wrong_dtype":
        save_npz(path, **{**fields, "start_offset": start_offset.astype(np.float64)})
    elif kind == "wrong_length":
        save_npz(path, **{**fields, "start_doc": start_doc[:-1], "start_offset": start_offset[:-1]})
    elif kind == "doc_id_out_of_range":
        save_npz(path, **{**fields, "doc_ids": np.where(doc_ids == doc_ids[0], 10**6, doc_ids)})
    elif kind == "start_doc_out_of_range":
        save_npz(path, **{**fields, "start_doc": start_doc + len(doc_ids)})
    elif kind == "start_offset_past_document":
        save_npz(path, **{**fields, "start_offset": start_offset + 10**6})
    elif kind == "samples_shifted":
        save_npz(path, **{**fields, "start_offset": np.maximum(start_offset - 1, 0)})


CACHE_DAMAGE = ["truncated", "empty", "random_bytes", "directory", "pickled_objects", "missing_array",
                "wrong_shape", "wrong_dtype", "wrong_length", "doc_id_out_of_range",
                "start_doc_out_of_range", "start_offset_past_document", "samples_shifted"]


@pytest.mark.parametrize("kind", CACHE_DAMAGE)
def test_damaged_cache_is_rebuilt_with_a_warning(stream_data, tmp_path, kind):
    ref = reference_arrays(stream_data)
    cache, reports = str(tmp_path / "cache"), []

    def build():
        return GPTDataset(stream_data, 16, seed=3, split="train", valid_fraction=0.1,
                          cache_dir=cache, report=reports.append)

    build().save_cache()
    _damage(build().cache_path, kind, ref)
    ds = build()
    assert not ds.loaded_from_cache
    assert len(reports) == 1 and reports[0].startswith(ds.cache_path + ": damaged") and "\n" not in reports[0]
    for got, want in zip((ds.doc_ids, ds.start_doc, ds.start_offset), ref):
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    ds.save_cache()  # replaces the damaged file; a directory is left alone, with a second line
    assert len(reports) == (2 if kind == "directory" else 1)
    assert build().loaded_from_cache == (kind != "directory")


def test_cache_warning_goes_to_stderr_by_default(stream_data, tmp_path, capsys):
    cache = tmp_path / "cache"
    ds = GPTDataset(stream_data, 16, seed=3, cache_dir=str(cache))
    cache.mkdir()
    open(ds.cache_path, "wb").write(b"garbage")
    GPTDataset(stream_data, 16, seed=3, cache_dir=str(cache))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {ds.cache_path}: damaged"), err


def test_cache_is_written_only_by_save_cache(stream_data, tmp_path):
    cache = tmp_path / "cache"
    ds = GPTDataset(stream_data, 16, seed=3, cache_dir=str(cache))
    assert not cache.exists()  # constructing writes nothing, not even the directory
    ds.save_cache()
    assert os.listdir(cache) == [os.path.basename(ds.cache_path)]
    mtime = os.path.getmtime(ds.cache_path)
    ds.save_cache()  # once only
    loaded = GPTDataset(stream_data, 16, seed=3, cache_dir=str(cache))
    loaded.save_cache()  # loaded: nothing to write
    assert loaded.loaded_from_cache and os.path.getmtime(ds.cache_path) == mtime
    assert os.listdir(cache) == [os.path.basename(ds.cache_path)]
    GPTDataset(stream_data, 16, seed=3).save_cache()  # no cache_dir: a no-op


def test_cache_save_failure_is_a_warning(stream_data, tmp_path):
    (tmp_path / "file").write_text("")
    reports = []
    ds = GPTDataset(stream_data, 16, seed=3, cache_dir=str(tmp_path / "file" / "cache"), report=reports.append)
    ds.save_cache()  # the cache directory cannot be created: the run goes on
    assert len(reports) == 1 and reports[0].startswith(ds.cache_path + ": cannot save"), reports
    assert sorted(os.listdir(tmp_path)) == ["file", "s.bin", "s.idx"]  # s: the stream_data fixture
    assert ds[0].shape == (17,)


def test_cache_save_sweeps_stale_temporaries(stream_data, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    ds = GPTDataset(stream_data, 16, seed=3, cache_dir=str(cache))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    token = "0" * tempfiles.TOKEN_HEX_DIGITS
    stale = cache / f"gpt-valid-L8-0123456789abcdef.npz.{socket.gethostname()}.{dead}.{token}.tmp"
    stale.write_bytes(b"left by a killed writer")
    ds.save_cache()
    assert os.listdir(cache) == [os.path.basename(ds.cache_path)]


def test_train_valid_disjoint(stream_data):
    n = len(stream_data)
    for frac in (0.001, 0.25):
        train = GPTDataset(stream_data, 8, seed=1, split="train", valid_fraction=frac)
        valid = GPTDataset(stream_data, 8, seed=1, split="valid", valid_fraction=frac)
        t, v = set(train.doc_ids.tolist()), set(valid.doc_ids.tolist())
        assert not t & v and t | v == set(range(n)) and len(v) == max(1, round(frac * n))
    with pytest.raises(DataError, match="valid split"):
        GPTDataset(stream_data, 8, seed=1, split="valid", valid_fraction=0.0)


def test_split_smaller_than_one_sample(tmp_path):
    data = IndexedDataset(write_dataset(tmp_path / "tiny", [[1, 2, 3], [4, 5]]))
    assert len(GPTDataset(data, 4, seed=0)) == 1  # 5 tokens = exactly one sample of 4 + 1
    with pytest.raises(DataError, match="tiny.idx"):
        GPTDataset(data, 5, seed=0)
    # a corpus of one document (one --format text file) is all held out: the refusal says so
    one = IndexedDataset(write_dataset(tmp_path / "one", [list(range(50))]))
    with pytest.raises(DataError, match=r"0 documents \(valid_fraction 0.02 holds out 1 of its 1\)"):
        GPTDataset(one, 4, seed=0, valid_fraction=0.02)
    # a held-out split too small for a sample says how to mend it
    few = IndexedDataset(write_dataset(tmp_path / "few", [list(range(1, 4))] * 10))
    GPTDataset(few, 8, seed=0, split="train", valid_fraction=0.1)
    with pytest.raises(DataError, match=r"the valid split has 3 tokens in 1 documents \(valid_fraction 0.1 holds out "
                                        r"these of its 10: raise it, or give data.valid_path\)"):
        GPTDataset(few, 8, seed=0, split="valid", valid_fraction=0.1)


# ----------------------------------------------------------------- loader

def test_loader_positions_contiguous(stream_data):
    ds = GPTDataset(stream_data, 8, seed=2)
    loader, batch = BatchLoader(ds, global_batch=6), 6
    batches = [loader.next_batch() for _ in range(len(ds) // batch + 2)]  # crosses an epoch
    assert loader.position == batch * len(batches)
    for n, got in enumerate(batches):
        assert got.shape == (batch, 9) and got.dtype == np.int32
        np.testing.assert_array_equal(got, np.stack([ds[n * batch + k] for k in range(batch)]))
        np.testing.assert_array_equal(got, loader.batch_at(n * batch))
    resumed = BatchLoader(ds, global_batch=batch, position=2 * batch)
    np.testing.assert_array_equal(resumed.next_batch(), batches[2])
    parts = [host_slice(batches[0], p, 3) for p in range(3)]
    assert all(len(p) == 2 for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), batches[0])
    with pytest.raises(ValueError):
        host_slice(batches[0], 0, 4)


# ----------------------------------------------------------------- default corpus

@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory):
    return default_corpus(str(tmp_path_factory.mktemp("corpus")))


def test_default_corpus(corpus_prefix):
    ds, tok = IndexedDataset(corpus_prefix), ByteTokenizer()
    assert ds.tokens > 1_000_000
    sources = stdlib_sources()
    paths = [p for p, _ in sources]
    assert paths == sorted(paths) and not any({"test", "tests"} & set(p.split("/")) for p in paths)
    assert len(ds) == len(sources)
    for i in (0, len(ds) - 1):
        assert tok.decode(ds.doc(i)) == sources[i][1] + EOD
    mtime = os.path.getmtime(corpus_prefix + ".bin")
    assert default_corpus(os.path.dirname(corpus_prefix)) == corpus_prefix  # cached, not rebuilt
    assert os.path.getmtime(corpus_prefix + ".bin") == mtime
    assert GPTDataset(ds, 128, seed=0, split="valid", valid_fraction=0.05)[0].shape == (129,)
    assert os.path.basename(corpus_prefix).endswith(f"-idx{indexed_mod.FORMAT_VERSION}")  # no old-format reuse


SLOW_CORPUS_BUILD = """
import sys, time
from mtjax.data import corpus
from mtjax.interrupts import Interrupted, raise_on_signals

real_sources = corpus.stdlib_sources

def slow_sources(max_bytes):  # the real documents, slowly, so the signal lands mid-build
    for source in real_sources(max_bytes):
        time.sleep(0.01)
        yield source

corpus.stdlib_sources = slow_sources
try:
    with raise_on_signals():
        corpus.default_corpus(sys.argv[1], int(sys.argv[2]))
except Interrupted as e:
    sys.exit(e.exit_status)
"""


def test_default_corpus_sigterm_leaves_nothing(tmp_path):
    cache, max_bytes = str(tmp_path), 1 << 20
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CORPUS_BUILD, cache, str(max_bytes)],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: tmp_files(cache), proc, "the build's temporary file")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert os.listdir(cache) == []  # no temporary, no partial .bin/.idx
    prefix = default_corpus(cache, max_bytes)
    ds, sources = IndexedDataset(prefix), stdlib_sources(max_bytes)
    assert len(ds) == len(sources) and sorted(os.listdir(cache)) == [os.path.basename(prefix) + s for s in (".bin", ".idx")]
    assert ByteTokenizer().decode(ds.doc(len(ds) - 1)) == sources[-1][1] + EOD


# ----------------------------------------------------------------- the index's settings, a raw file's hint

def bos_corpus(directory):
    """DOCS-like texts made with the fixture tokenizer and --add-bos into `directory`/c, with the
    tokenizer file copied beside them (where training looks for it)."""
    pytest.importorskip("tokenizers")
    import shutil
    from tokenizer_fixture import FIXTURE
    os.makedirs(directory, exist_ok=True)
    docs = write_jsonl(os.path.join(directory, "docs.jsonl"), ["the cat sat on the mat", "the dog ate the cat"] * 20)
    preprocess([docs], os.path.join(directory, "c"), load_tokenizer(FIXTURE, add_bos=True), add_bos=True)
    shutil.copyfile(FIXTURE, os.path.join(directory, "tokenizer.json"))
    return os.path.join(directory, "c")


def test_training_takes_the_tokenizer_and_bos_the_index_records(tmp_path):
    """data.tokenizer unset on data made with a tokenizer file and --add-bos: the run takes the
    file (found beside the data by its content), add_bos and the tokens, and saves them; a
    tokenizer that is nowhere to be found, or an explicit add_bos=false, is one line naming the key."""
    from mtjax.config import load_config
    from mtjax.config.errors import ConfigError
    from mtjax.training.data_setup import build_datasets, tokenizer_vocab
    prefix = bos_corpus(str(tmp_path / "data"))
    base = [f"data.path={prefix}", f"data.cache_dir={tmp_path}/cache", "model.seq_len=16", "data.valid_fraction=0"]
    cfg = load_config(None, base)
    data = build_datasets(cfg)
    dc = data.config.data
    assert (dc.tokenizer, dc.add_bos, dc.bos_token, dc.eod_token) == \
        (str(tmp_path / "data" / "tokenizer.json"), True, "<|begin_of_text|>", "<|end_of_text|>")
    assert data.vocab == 300 and tokenizer_vocab(cfg) == 300 and data.config.model == cfg.model
    # named explicitly, the settings are the config's: add_bos left false disagrees with the data
    with pytest.raises(ConfigError) as e:
        build_datasets(load_config(None, [*base, f"data.tokenizer={dc.tokenizer}"]))
    assert e.value.key == "data.add_bos"
    os.remove(tmp_path / "data" / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"c\.idx was made with the tokenizer tokenizer\.json .* and BOS before "
                                          r"each document, .*give data\.tokenizer=PATH data\.add_bos=true") as e:
        build_datasets(cfg)
    assert e.value.key == "data.tokenizer"


def test_a_raw_text_data_path_gets_the_preprocess_command(tmp_path, capsys):
    """A .jsonl (or a token file) as data.path: the line says what to give instead."""
    from mtjax.cli import report
    from mtjax.config import load_config
    from mtjax.train import main
    raw = write_jsonl(tmp_path / "x.jsonl", ["hello"])
    status = report(main, ["--config", os.path.join(REPO, "configs", "tiny.yaml"), f"data.path={raw}"])
    err = capsys.readouterr().err.strip().splitlines()
    prefix = str(tmp_path / "x")
    assert status == 2 and err == [
        f"error: data.path: {raw} is raw text, not a prefix of token files; preprocess it first: python -m "
        f"mtjax.data.preprocess --input {raw} --output {prefix} [--tokenizer tokenizer.json], then give "
        f"data.path={prefix}"], err
    write_dataset(prefix, [[1, 2, 3]])
    from mtjax.config.errors import ConfigError
    with pytest.raises(ConfigError, match=f"data.path\\[2\\].*{prefix}.bin is a token file; give its prefix: "
                                          f"data.path={prefix}$"):
        load_config(None, [f"data.path=0.5 {prefix} 0.5 {prefix}.bin"])
    with pytest.raises(ConfigError, match=f"its token files are {prefix}.bin/.idx: give data.path={prefix}$"):
        load_config(None, [f"data.path={raw}"])
