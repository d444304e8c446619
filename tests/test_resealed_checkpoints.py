"""A checkpoint whose files pass their manifest but hold what no save writes (edited and resealed:
`manifest.write_manifest` run over them) is refused in one line naming the checkpoint, exit 2,
nothing written: never a traceback, and never read into other weights without a word (orbax would
cast an int32 array to float32, and the vocabulary recorded in `meta` cuts the embedding).

The unreadable array runs the command in a process of its own: orbax's other reads end after its
error, from their own threads, and only the entry point (`cli.run`) keeps their echoes off stderr."""
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mtjax import cli
from mtjax.checkpoint import manifest
from mtjax.commands import convert as convert_cli
from test_cli import child_env
from test_cli_inputs import REPO, run_dir, snapshot   # noqa: F401  (run_dir: llama_plain from-hf, the source)

STEP = os.path.join("checkpoints", "0")


def _json(item, edit):
    def damage(run):
        path = os.path.join(run, STEP, item, "metadata")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        edit(data)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    return damage


def _truncate(run):
    files = [f for f in glob.glob(os.path.join(run, STEP, "state", "d", "*")) if os.path.isfile(f)]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)


def _embedding_as_int32(run):
    import orbax.checkpoint as ocp
    state = os.path.join(run, STEP, "state")
    with ocp.PyTreeCheckpointer() as reader:
        tree = reader.restore(state)
    tree["params"]["embed"]["embedding"] = np.asarray(tree["params"]["embed"]["embedding"]).astype(np.int32)
    shutil.rmtree(state)
    with ocp.PyTreeCheckpointer() as writer:
        writer.save(state, tree)


CASES = [  # (id, damage, what the line says after the checkpoint's name)
    ("vocab_zero", _json("meta", lambda m: m.update(vocab=0)), "vocab 0 and padded_vocab 384 must be whole numbers"),
    ("vocab_not_the_models", _json("meta", lambda m: m.update(vocab=200)),
     "its vocab 200 is not its config's model.vocab_size 300"),
    ("heads_not_dividing", _json("config", lambda c: c["model"].update(num_heads=3)),
     "describes no model: model.hidden_size: hidden_size 32 is not divisible by num_heads 3"),
    ("size_a_string", _json("config", lambda c: c["model"].update(hidden_size="32")),
     "describes no model: model.hidden_size: expected int"),
    # a recorded sliding window that to-hf would have read as a dict (a traceback) or written as it is
    ("window_a_list", _json("meta", lambda m: m.update(hf_family="mistral", hf_sliding_window=[64])),
     "has unreadable metadata: hf_sliding_window [64] is not"),
    ("window_not_a_number", _json("meta", lambda m: m.update(hf_family="mistral",
                                                             hf_sliding_window={"window": "64", "layers": [0]})),
     "has unreadable metadata: hf_sliding_window {'window': '64', 'layers': [0]} is not"),
    ("truncated_array", _truncate, "cannot be restored: OUT_OF_RANGE"),
    ("int32_embedding", _embedding_as_int32, "stores params.embed.embedding as int32, this model's is float32"),
]


@pytest.mark.parametrize("case,damage,words", CASES, ids=[c[0] for c in CASES])
def test_a_resealed_checkpoint_is_one_line_exit_2(run_dir, tmp_path, capsys, case, damage, words):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    damage(str(run))
    manifest.write_manifest(os.path.join(run, STEP))
    before = snapshot(tmp_path)
    argv = ["to-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]
    if case == "truncated_array":
        env = child_env(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-m", "mtjax.convert", *argv], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
        status, err = r.returncode, r.stderr.strip().splitlines()
    else:
        status = cli.report(convert_cli.main, argv)
        err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint step 0 in {run / 'checkpoints'}") and words in err[0], err
    assert "tensorstore_spec" not in err[0]            # tensorstore's spec (kilobytes of JSON) left out
    assert snapshot(tmp_path) == before
