"""Fine-tuning: `train.init_from` starts a run from a converted model's weights on any layout, and
the data must have been made by the run's tokenizer (tokenizer.json options for real models).

The proof: a Hugging Face Llama fixture converted by from-hf, then one training step from it
(train.init_from) on (data, pipe, tensor) = (2, 2, 2) with the distributed optimizer and on
context = 2 (ring attention), equals the same step on one device (loss and every updated
parameter, fp32, relative error < 1e-5), and the weights it starts from are the converted ones bit for bit.
"""
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from layouts import leaf_errors
from test_cli import cli_forked, snapshot, train_cli
from tokenizer_fixture import FIXTURE as TOKENIZER, make_tokenizer
from mtjax.commands.convert_hf import from_hf
from mtjax.config import load_config
from mtjax.config.errors import ConfigError
from mtjax.convert.checkpoints import leaf_path, load_params
from mtjax.data import IndexedDataset, IndexedWriter, load_tokenizer
from mtjax.data.build_index import preprocess
from mtjax.data.errors import DataError
from mtjax.mesh import make_mesh
from mtjax.checkpoint.init_from import find_source, initial_state
from mtjax.training.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
HF = REPO / "tests" / "fixtures" / "hf" / "llama"     # Llama 3.1-style: GQA, llama3 rope, untied, V = 320
SEQ = 16
VOCAB_AXIS = {"embed/embedding": 0, "lm_head/kernel": 1}
TOL = 1e-5
BOS, EOD = 0, 1                                       # the fixture tokenizer's <|begin_of_text|>, <|end_of_text|>
DOCS = ["the cat sat on the mat", "the dog ate the cat <|end_of_text|> and the mat",
        "def f(x):\n    return '<|begin_of_text|>' + x  # <|endoftext|>", "Hello, world."] * 12


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """from-hf's run directory for the Llama fixture (s = 16)."""
    out = tmp_path_factory.mktemp("hf") / "llama"
    from_hf(str(HF), str(out), seq_len=SEQ)
    return out


def write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """{name: prefix}: DOCS made with the fixture tokenizer (with and without BOS), and with bytes."""
    d = tmp_path_factory.mktemp("corpus")
    docs = write_jsonl(d / "docs.jsonl", DOCS)
    made = {}
    for name, spec, add_bos in (("hf", TOKENIZER, False), ("hf_bos", TOKENIZER, True), ("byte", "byte", False)):
        preprocess([docs], str(d / name), load_tokenizer(spec, add_bos=add_bos), add_bos=add_bos)
        made[name] = str(d / name)
    return made


def cut_vocab(leaves: dict, vocab: int) -> dict:
    """The parameters with their vocabulary axis cut to V (the padding depends on t); the cut rows
    must be zeros."""
    out = {}
    for path, x in leaves.items():
        x = np.asarray(x)
        if path in VOCAB_AXIS:
            axis = VOCAB_AXIS[path]
            assert not np.take(x, np.arange(vocab, x.shape[axis]), axis=axis).any(), path
            x = np.take(x, np.arange(vocab), axis=axis)
        out[path] = x
    return out


def flat(params) -> dict:
    return {leaf_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(params))}


def one_step(out: Path, tmp: Path, data: int, pipe: int, tensor: int, extra=()):
    """(starting parameters, loss, updated parameters) of one step from `out` by train.init_from."""
    cfg = load_config(str(out / "config.yaml"), [
        f"train.init_from={out}", f"train.run_dir={tmp}", f"parallel.data={data}", f"parallel.pipe={pipe}",
        f"parallel.tensor={tensor}", "train.global_batch=4", "train.micro_batch=1", "optim.warmup_steps=0",
        "optim.lr=0.001", *extra])
    c = cfg.parallel.context
    mesh = make_mesh(data, pipe, tensor, jax.devices()[:data * pipe * c * tensor], context=c)
    trainer = Trainer(cfg, mesh, cfg.model.vocab_size)
    state = initial_state(find_source(cfg), trainer)
    assert int(state.step) == 0 and int(state.data_position) == 0
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(jax.device_get(state.opt_state)))   # fresh moments
    start = cut_vocab(flat(trainer.canonical(state.params)), cfg.model.vocab_size)
    batch = np.random.RandomState(0).randint(0, cfg.model.vocab_size, (4, SEQ + 1))
    state, metrics = trainer.train_step(state, trainer.put_batch(batch))
    return start, float(metrics["loss"]), cut_vocab(flat(trainer.canonical(state.params)), cfg.model.vocab_size)


@pytest.mark.filterwarnings("error:Some donated buffers were not usable")    # (init_from donates only where it can)
def test_one_step_from_a_converted_model_is_the_same_on_every_layout(converted, tmp_path):
    _, vocab, leaves, _ = load_params(str(converted))
    converted_leaves = cut_vocab(leaves, vocab)
    start, loss, after = one_step(converted, tmp_path, 1, 1, 1)
    assert sorted(start) == sorted(converted_leaves)
    for path, x in converted_leaves.items():
        assert start[path].dtype == x.dtype and np.array_equal(start[path], x), path   # bitwise
    # (cut: tensor = 2 alone, whose split of the converted weights the (2, 2, 2) layout makes too)
    for layout, extra in (((2, 2, 2), ["parallel.distributed_optimizer=true"]),
                          ((1, 1, 1), ["parallel.context=2", "parallel.context_attention=ring"])):
        start_t, loss_t, after_t = one_step(converted, tmp_path, *layout, extra)
        for path, x in converted_leaves.items():
            assert np.array_equal(start_t[path], x), (layout, path)
        assert abs(loss_t - loss) / loss < TOL, (layout, loss_t, loss)
        errs = leaf_errors(after_t, after)
        assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
        moved = leaf_errors(after_t, start)        # the step changed every leaf: the comparison means something
        assert min(moved.values()) > 10 * TOL, moved


def test_init_from_needs_the_same_model(converted, tmp_path):
    cfg = load_config(str(converted / "config.yaml"), [f"train.init_from={converted}", "model.norm_eps=1e-6"])
    with pytest.raises(ConfigError, match=r"^train\.init_from: checkpoint step 0 was saved with model\.norm_eps=1e-05, "
                                          r"the config says 1e-06") as e:
        find_source(cfg)
    assert "\n" not in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = load_config(str(converted / "config.yaml"), [f"train.init_from={empty}"])
    with pytest.raises(ConfigError, match="train.init_from: .*holds no complete mtjax checkpoint"):
        find_source(cfg)


# ----------------------------------------------------------------- tokenizers of real models

def test_the_fixture_tokenizer_is_what_its_script_makes(tmp_path):
    make_tokenizer().save(str(tmp_path / "t.json"), pretty=True)
    assert (tmp_path / "t.json").read_bytes() == Path(TOKENIZER).read_bytes()


def test_eod_and_bos_come_from_the_tokenizer_or_are_named(tmp_path):
    """Llama 3's <|end_of_text|> (a special token, in no fixed list before) ends documents; its
    post-processor template names BOS. GPT-2's <|endoftext|> likewise, with no BOS at all."""
    tok = load_tokenizer(TOKENIZER)
    assert (tok.eod_id, tok.bos_id) == (EOD, BOS)
    assert tok.token(tok.eod_id) == "<|end_of_text|>" and tok.token(tok.bos_id) == "<|begin_of_text|>"
    named = load_tokenizer(TOKENIZER, eod_token="<|begin_of_text|>", bos_token="<|end_of_text|>")
    assert (named.eod_id, named.bos_id) == (BOS, EOD)
    with pytest.raises(DataError, match="has no token '<eot>'"):
        load_tokenizer(TOKENIZER, eod_token="<eot>")
    make_tokenizer(specials=("<|endoftext|>",), bos=None).save(str(tmp_path / "gpt2.json"))
    gpt2 = load_tokenizer(str(tmp_path / "gpt2.json"))
    assert gpt2.token(gpt2.eod_id) == "<|endoftext|>" and gpt2.bos_id is None
    with pytest.raises(DataError, match="no beginning-of-document token"):
        load_tokenizer(str(tmp_path / "gpt2.json"), add_bos=True)


def test_special_token_literals_in_text_are_text(corpus, tmp_path):
    """`<|end_of_text|>` written inside a document is encoded as its characters, never as the
    EOD id: each document holds EOD once, at its end, and decodes back to its text."""
    tok = load_tokenizer(TOKENIZER)
    data = IndexedDataset(corpus["hf"])
    assert len(data) == len(DOCS)
    for i, text in enumerate(DOCS):
        ids = data.doc(i).tolist()
        assert ids[-1] == EOD and EOD not in ids[:-1] and BOS not in ids, (text, ids)
        assert tok.decode(ids[:-1]) == text
    assert data.record == {"tokenizer": {"name": "tokenizer.json", **_size_crc(TOKENIZER)}, "vocab_size": 300,
                           "eod_id": EOD, "bos_id": BOS, "add_bos": False}
    # a tokenizer whose vocabulary holds the literal as a word cannot keep it as text: refused
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.train_from_iterator(["a b"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    words.save(str(tmp_path / "words.json"))
    docs = write_jsonl(tmp_path / "d.jsonl", ["a b", "a </s> b"])
    with pytest.raises(DataError, match=r"d\.jsonl:2: the text encodes to id 1 \('</s>'\)"):
        preprocess([docs], str(tmp_path / "w"), load_tokenizer(str(tmp_path / "words.json")))
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "words.json"]


def _size_crc(path):
    import zlib
    data = Path(path).read_bytes()
    return {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def preprocess_cli(args, cwd):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "mtjax.data.preprocess", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_preprocess_cli_add_bos_and_literals(tmp_path):
    """--add-bos puts BOS first in every document, EOD last, and nowhere else; --add-bos with a
    tokenizer that has no BOS is one line, exit 2, nothing written."""
    docs = write_jsonl(tmp_path / "docs.jsonl", DOCS[:4])
    r = preprocess_cli(["--input", docs, "--output", str(tmp_path / "bos"), "--tokenizer", TOKENIZER, "--add-bos"],
                       tmp_path)
    assert r.returncode == 0, r.stderr
    data, tok = IndexedDataset(str(tmp_path / "bos")), load_tokenizer(TOKENIZER)
    for i, text in enumerate(DOCS[:4]):
        ids = data.doc(i).tolist()
        assert ids[0] == BOS and ids[-1] == EOD and BOS not in ids[1:] and EOD not in ids[:-1], ids
        assert tok.decode(ids[1:-1]) == text
    assert data.record["add_bos"] is True and data.record["bos_id"] == BOS
    before = snapshot(tmp_path)
    r = preprocess_cli(["--input", docs, "--output", str(tmp_path / "x"), "--add-bos"], tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: --add-bos: the byte tokenizer has no beginning-of-document token"], r.stderr
    r = preprocess_cli(["--input", docs, "--output", str(tmp_path / "x"), "--tokenizer", TOKENIZER,
                        "--eod-token", "<eot>"], tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and \
        r.stderr.startswith("error: --eod-token: ") and "has no token '<eot>'" in r.stderr, r.stderr
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------- the command line

def train_args(config, tmp, extra):
    return ["--config", str(config), f"train.run_dir={tmp}/run", f"data.cache_dir={tmp}/cache",
            "train.steps=1", "train.global_batch=2", "train.micro_batch=2", "train.eval_interval=0",
            "train.progress=false", "data.valid_fraction=0", *extra]


def test_bad_init_from_or_data_is_one_line_exit_2_and_writes_nothing(converted, corpus, tmp_path_factory):
    """A missing or empty init_from, data made by another tokenizer, data that records no
    tokenizer, other EOD or BOS settings: each refused in one line naming the key, nothing written."""
    old = tmp_path_factory.mktemp("old") / "old"
    with IndexedWriter(str(old), np.uint16) as w:          # recorded nothing, as if made before the record
        w.add_document(np.arange(100) % 256)
    hf = [f"data.path={corpus['hf']}", f"data.tokenizer={TOKENIZER}"]
    cases = {
        "missing": (["train.init_from={tmp}/nope", *hf], "error: train.init_from: {tmp}/nope does not exist"),
        "no_checkpoint": (["train.init_from={tmp}", *hf], "holds no complete mtjax checkpoint"),
        "other_tokenizer": ([f"data.path={corpus['byte']}", f"data.tokenizer={TOKENIZER}"],
                            f"error: data.tokenizer: {corpus['byte']}.idx was made with the tokenizer byte, "
                            f"this run's is tokenizer.json ("),
        "other_tokenizer_byte": ([f"data.path={corpus['hf']}"], "error: data.tokenizer: "),
        "no_record": ([f"data.path={old}", f"data.tokenizer={TOKENIZER}"],
                      f"error: {old}.idx: does not record which tokenizer made it; re-create it"),
        "other_eod": ([*hf, "data.eod_token=<|begin_of_text|>"], "error: data.eod_token: "),
        "bos_missing": ([*hf, "data.add_bos=true"], "error: data.add_bos: is true but"),
        "bos_unexpected": ([f"data.path={corpus['hf_bos']}", f"data.tokenizer={TOKENIZER}"], "error: data.add_bos: "),
        "byte_bos": (["data.add_bos=true"], "error: data.add_bos: the byte tokenizer has no"),
    }

    tmps = {name: tmp_path_factory.mktemp(name) for name in cases}
    jobs = [(train_args(converted / "config.yaml", tmps[name], [a.replace("{tmp}", str(tmps[name])) for a in extra]),
             tmps[name]) for name, (extra, _) in cases.items()]
    before, source = {name: snapshot(tmp) for name, tmp in tmps.items()}, snapshot(converted)
    runs = cli_forked(jobs, str(tmp_path_factory.mktemp("streams")), timeout=240)
    source_unchanged = source == snapshot(converted)
    results = {name: (r, expect.replace("{tmp}", str(tmps[name])), before[name] == snapshot(tmps[name]),
                      source_unchanged) for (name, (_, expect)), r in zip(cases.items(), runs)}
    for name, (r, expect, unchanged, source_unchanged) in results.items():
        lines = r.stderr.splitlines()
        assert r.returncode == 2 and len(lines) == 1 and expect in lines[0], (name, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and unchanged and source_unchanged, name


def test_fine_tune_from_a_converted_model_then_resume(converted, corpus, tmp_path):
    """train.init_from on tensor = 2 with BOS-prefixed data: the run starts from the converted
    weights, writes nothing into them, and once it has checkpoints of its own it resumes from
    those (and says that init_from is not read); its checkpoints keep the family from-hf recorded."""
    source = snapshot(converted)
    config = tmp_path / "config.yaml"                   # its model group, kept when the source is gone
    config.write_text((converted / "config.yaml").read_text())
    args = train_args(config, tmp_path, [
        f"train.init_from={converted}", f"data.path={corpus['hf_bos']}", f"data.tokenizer={TOKENIZER}",
        "data.add_bos=true", "--cpu-devices", "2", "parallel.tensor=2"])
    r = train_cli(args, tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"started from the weights of checkpoint step 0 in {converted}/checkpoints (train.init_from)" in r.stdout
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1] and np.isfinite(rows[0]["loss"])
    assert snapshot(converted) == source

    away = converted.with_name("away")
    os.rename(converted, away)              # a resume neither reads the source nor needs it
    try:
        r = train_cli([*args, "train.steps=2"], tmp_path, timeout=300)
    finally:
        os.rename(away, converted)
    assert r.returncode == 0, r.stderr
    assert "resumed from checkpoint step 1" in r.stdout and f"train.init_from={converted} is not read" in r.stdout
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1", "2"]
    from mtjax.checkpoint.params import saved_config      # the weights' origin, carried on (to-hf's family)
    assert [saved_config(str(tmp_path / "run" / "checkpoints"), step)[0]["hf_family"] for step in (1, 2)] == ["llama"] * 2
