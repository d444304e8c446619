"""Token files mapped a bounded number at a time (`mtjax/data/open_files.py`).

A blend of more corpora than the process may open files is read, under a lowered
RLIMIT_NOFILE in a subprocess, exactly as the same blend is read with every corpus mapped;
the cache itself is checked for its bound, its order of eviction and a file made again
under it."""
import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mtjax.config import load_config
from mtjax.data import BatchLoader, ByteTokenizer, IndexedDataset, IndexedWriter
from mtjax.data.errors import DataError
from mtjax.data.open_files import OpenFiles, default_capacity, too_many_open
from mtjax.data.tokenizer import record
from mtjax.training.data_setup import build_datasets
from test_cli import REPO, child_env

CORPORA, LIMIT = 200, 64


def write_corpus(prefix, seed, docs=6):
    """Byte-tokenized random documents (10 to 40 letters and EOD) at `prefix`."""
    rng, tok = np.random.default_rng(seed), ByteTokenizer()
    with IndexedWriter(str(prefix), np.uint16, record(tok, False)) as w:
        for _ in range(docs):
            w.add_document(list(rng.integers(97, 123, rng.integers(10, 40))) + [tok.eod_id])
    return str(prefix)


def read_blend(blend):
    """The blend's first 100 global batches of 8 rows, and how many files its corpora left mapped."""
    cfg = load_config(None, [f"data.path={blend}", "model.seq_len=16", "train.global_batch=8", "train.micro_batch=1",
                             "data.valid_fraction=0"])
    data = build_datasets(cfg)
    loader = BatchLoader(data.train, 8)
    return np.stack([loader.next_batch() for _ in range(100)]), len(data.corpora[0].indexed._files)


# read_blend in a process whose file limit is argv[3], its batches saved to argv[2]; then the error
# of a cache larger than the limit allows
UNDER_LIMIT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    sys.path.insert(0, "tests")
    from test_open_files import read_blend
    batches, mapped = read_blend(sys.argv[1])
    np.save(sys.argv[2], batches)
    print(mapped)
    from mtjax.data import IndexedDataset
    from mtjax.data.open_files import OpenFiles
    files = OpenFiles(4 * int(sys.argv[3]))           # more than the limit allows: the error names it
    try:
        [IndexedDataset(p, files=files).doc(0) for p in sys.argv[1].split()[1::2]]
    except OSError as e:
        print(f"{e.filename}: {e.strerror}")
""")


def test_a_blend_past_the_file_limit_reads_as_with_every_corpus_mapped(tmp_path):
    blend = " ".join(f"{1 + k % 3} {write_corpus(tmp_path / f'c{k}', k)}" for k in range(CORPORA))
    script = tmp_path / "under_limit.py"
    script.write_text(UNDER_LIMIT)
    done = subprocess.run([sys.executable, str(script), blend, str(tmp_path / "b.npy"), str(LIMIT)],
                          cwd=REPO, env=child_env(PYTHONPATH=REPO), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    mapped, error = done.stdout.splitlines()
    assert int(mapped) == LIMIT // 4                                       # a quarter of the limit mapped
    assert error.endswith(f".bin: cannot open: the process has reached its limit of {LIMIT} open files "
                          "(RLIMIT_NOFILE; raise it with `ulimit -n`)"), error
    whole, mapped = read_blend(blend)          # here: every corpus mapped where the limit is 800 or more
    assert mapped == min(CORPORA, default_capacity())
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), whole)
    assert len({tuple(r) for r in whole.reshape(-1, 17)}) > 700            # distinct windows: the blend was read


def test_the_least_recently_read_file_is_unmapped_first(tmp_path):
    files = OpenFiles(2)
    sets = [IndexedDataset(write_corpus(tmp_path / f"c{k}", k), files=files) for k in range(3)]
    expected = [[np.fromfile(s.bin_path, np.uint16)[s.offsets[i]:s.offsets[i + 1]] for i in range(len(s))]
                for s in sets]
    for k in (0, 1, 0, 2, 1, 2, 0):
        for i in range(len(sets[k])):
            np.testing.assert_array_equal(sets[k].doc(i), expected[k][i])
        assert len(files) <= 2
    assert list(files._maps) == [sets[2].bin_path, sets[0].bin_path]        # 1 was read least recently


def test_a_corpus_made_again_while_in_use_is_read_only_with_the_same_tokens(tmp_path):
    files = OpenFiles(1)
    a, b = (IndexedDataset(write_corpus(tmp_path / name, k), files=files) for k, name in enumerate("ab"))
    first = a.doc(0).copy()
    b.doc(0)                                      # a is unmapped
    os.rename(a.bin_path, tmp_path / "old.bin")   # the same tokens in another file under its name
    write_corpus(tmp_path / "a", 0)               # (another process's copy of the corpus): read
    np.testing.assert_array_equal(a.doc(0), first)
    assert a._identity[1] == os.stat(a.bin_path).st_ino      # and taken as the file from now on
    b.doc(0)
    write_corpus(tmp_path / "a", 7)               # made again with other tokens: refused
    with pytest.raises(DataError, match=rf"^{a.bin_path}: changed since it was opened"):
        a.doc(0)
    os.remove(a.bin_path)
    with pytest.raises(DataError, match=rf"^{a.bin_path}: removed since it was opened"):
        a.doc(0)


def test_the_file_limit_is_named_when_reached():
    e = too_many_open("/d/x.bin", OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
    assert e.errno == errno.EMFILE and e.filename == "/d/x.bin"
    assert "limit of" in e.strerror and "open files (RLIMIT_NOFILE" in e.strerror
    other = OSError(errno.EIO, "I/O error")
    assert too_many_open("/d/x.bin", other) is other
