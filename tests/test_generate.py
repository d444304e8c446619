"""Generation from a checkpoint: `mtjax.load`, the KV-cache decoder and `python -m mtjax.generate`.

The oracle for the cache is decoding without one: each next token is the argmax of the trainer's
`logits_fn` over the whole prefix (padded to seq_len: under the causal mask a prefix has the
logits the full sequence has there). Greedy decoding from the cache must choose the very same
tokens on every tensor size, for Llama (RoPE, GQA with k = 2 < t = 4 replicated) and GPT (learned
positions); its logits agree to rounding (the single-position matmuls and the masked attention
over the whole cache sum in another order, so they are not bitwise equal).
The checkpoints are written in-process (random weights, init_std 0.2 so that the logits are far
from ties) and shared, with the loaded models, by every test of the module. On (data, pipe,
tensor) meshes the oracle is one device: the same greedy and the same seeded tokens.
"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtjax
from layouts import VOCAB, tiny_config
from mtjax.config.errors import ConfigError
from mtjax.inference.sampling import filter_logits, next_tokens
from mtjax.mesh import make_mesh
from mtjax.model.attention import KVCache
from mtjax.checkpoint import Checkpointer
from mtjax.training.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 17, 42]
NEW = 10            # 3 + 10 of the 16 positions


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> a run directory holding one checkpoint (step 0) of tiny_config's model."""
    out = {}
    for arch in ("llama", "gpt"):
        run = tmp_path_factory.mktemp(arch)
        cfg = tiny_config(arch, extra=["model.init_std=0.2", f"train.run_dir={run}", "checkpoint.async_save=false"])
        trainer = Trainer(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), VOCAB)
        checkpointer = Checkpointer(cfg)
        checkpointer.save(trainer.init_state(), trainer)
        checkpointer.close()
        out[arch] = run
    return out


@pytest.fixture(scope="module")
def models(checkpoints):
    """(arch, t) -> the checkpoint loaded on a (1, 1, t) mesh; (arch, overrides=[...]) -> loaded
    on the mesh its parallel.* overrides name (each loaded once)."""
    loaded = {}

    def get(arch, t=1, overrides=()):
        key = (arch, t, tuple(overrides))
        if key not in loaded:
            mesh = make_mesh(1, 1, t, jax.devices()[:t]) if not overrides else None
            loaded[key] = mtjax.load(str(checkpoints[arch]), mesh, overrides)
        return loaded[key]
    return get


def greedy_without_cache(model, prompt, new):
    """Each next token the argmax of the full forward over the prefix so far."""
    seq = list(prompt)
    for _ in range(new):
        tokens = np.zeros((1, model.seq_len), np.int32)
        tokens[0, :len(seq)] = seq
        seq.append(int(np.argmax(model.logits(tokens)[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch,t", [("llama", 1), ("llama", 2), ("llama", 4), ("gpt", 1), ("gpt", 2)])
def test_greedy_from_the_cache_equals_decoding_without_it(models, arch, t):
    model = models(arch, t)
    tokens = model.generate(PROMPT, NEW)
    assert tokens == greedy_without_cache(model, PROMPT, NEW)
    assert len(tokens) == NEW and all(0 <= i < VOCAB for i in tokens)
    assert tokens == models(arch, 1).generate(PROMPT, NEW)        # the same on every tensor size


def test_logits_are_the_trainers_and_the_cache_path_agrees(models, checkpoints):
    """`.logits` is the trainer's logits_fn on the restored parameters (bitwise); t = 2 agrees to
    rounding; the decode path (a prefill in two chunks, the second written at position 7) gives
    the same logits at every position."""
    model = models("llama")
    cfg = tiny_config("llama", extra=["model.init_std=0.2", f"train.run_dir={checkpoints['llama']}"])
    trainer = Trainer(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), VOCAB)
    checkpointer = Checkpointer(cfg)
    try:
        params = checkpointer.restore(0, trainer).params
    finally:
        checkpointer.close()
    tokens = np.random.RandomState(0).randint(0, VOCAB, (2, 16)).astype(np.int32)
    expected = np.asarray(trainer.logits_fn(params, tokens))
    logits = model.logits(tokens)
    assert logits.shape == (2, 16, VOCAB) and np.array_equal(logits, expected)
    np.testing.assert_allclose(models("llama", 2).logits(tokens[:, :9]), expected[:, :9], atol=2e-5)

    decoder = model.decoder
    cache, chunks = decoder.empty_cache(2), []
    for start, stop in ((0, 7), (7, 16)):
        out, cache = decoder.model.apply({"params": model.params}, tokens[:, start:stop], cache,
                                         jnp.full((2,), start, jnp.int32), method="decode")
        chunks.append(np.asarray(out)[..., :VOCAB])
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), expected, atol=2e-5)
    assert isinstance(cache, KVCache) and cache.k.shape == (2, 2, 16, 2, 4)     # [l, b, S, k, d]


def test_a_batch_of_prompts_of_different_lengths_decodes_each_as_alone(models):
    model = models("gpt")
    prompts = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert model.generate(prompts, 5) == [model.generate(p, 5) for p in prompts]


def test_sampling_is_reproducible_and_top_k_1_is_greedy(models):
    model = models("llama")
    greedy = model.generate(PROMPT, NEW)
    first = model.generate(PROMPT, NEW, temperature=1.0, seed=1)
    assert first == model.generate(PROMPT, NEW, temperature=1.0, seed=1)
    assert first != model.generate(PROMPT, NEW, temperature=1.0, seed=2)
    assert first != greedy
    assert model.generate(PROMPT, NEW, temperature=1.0, top_k=1, seed=3) == greedy
    assert model.generate(PROMPT, NEW, temperature=5.0, top_p=1e-6, seed=4) == greedy   # a nucleus of one
    filtered = model.generate(PROMPT, NEW, temperature=1.0, top_k=5, top_p=0.9, seed=1)
    assert len(filtered) == NEW


def test_stop_at_eod_ends_after_the_first_end_of_document(models):
    model = models("llama")
    greedy = model.generate(PROMPT, NEW)
    stop = greedy[4]
    model.__dict__["tokenizer"] = type("Eod", (), {"eod_id": stop})()      # its end-of-document id
    try:
        assert model.generate(PROMPT, NEW, stop_at_eod=True) == greedy[:greedy.index(stop) + 1]
    finally:
        del model.__dict__["tokenizer"]
    assert model.tokenizer.eod_id == 256                                      # the byte tokenizer's


def test_filters_keep_top_k_then_the_nucleus():
    z = jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda k, p: np.isfinite(np.asarray(filter_logits(z, jnp.int32(k), jnp.float32(p))))[0]  # noqa: E731
    assert kept(2, 1.0).tolist() == [False, True, False, True, False]
    assert kept(5, 0.5).tolist() == [False, True, False, True, False]      # 0.4 < 0.5 <= 0.4 + 0.3
    assert kept(5, 0.8).tolist() == [False, True, False, True, True]
    assert kept(5, 0.01).tolist() == [False, True, False, False, False]
    assert kept(3, 0.9).tolist() == [False, True, False, True, True]       # top-3 renormalised: 0.47, 0.35
    tied = np.isfinite(np.asarray(filter_logits(jnp.array([[1.0, 3.0, 3.0, 0.0, 2.0]]), jnp.int32(1), jnp.float32(1))))
    assert tied[0].tolist() == [False, True, True, False, False]           # ties with the k-th stay (docs)
    # a tiny temperature is greedy, the limit: z / T overflowed to +inf for every positive logit,
    # and the draw took the lowest of them (id 0, outside the top 2)
    big = jnp.tile(jnp.array([[10.0, 30.0, 20.0, 0.5, -1.0]]), (4000, 1))       # the shape below: no new compile
    tiny = next_tokens(big, jax.random.key(0), jnp.float32(2e-38), jnp.int32(2), jnp.float32(1))
    assert np.asarray(tiny).tolist() == [1] * 4000
    draws = next_tokens(jnp.tile(z, (4000, 1)), jax.random.key(0), jnp.float32(1), jnp.int32(3), jnp.float32(1))
    freq = np.bincount(np.asarray(draws), minlength=5) / 4000
    np.testing.assert_allclose(freq, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85], atol=0.03)


@pytest.mark.parametrize("call,key", [
    (dict(prompt_ids=PROMPT, max_new_tokens=14), "max_new_tokens"),      # 3 + 14 > 16
    (dict(prompt_ids=[1, VOCAB], max_new_tokens=2), "prompt_ids"),
    (dict(prompt_ids=[], max_new_tokens=2), "prompt_ids"),
    (dict(prompt_ids=PROMPT, max_new_tokens=2, top_p=0.0), "top_p"),
    (dict(prompt_ids=PROMPT, max_new_tokens=2, top_k=0), "top_k"),
    (dict(prompt_ids=PROMPT, max_new_tokens=2, temperature=-1.0), "temperature"),
    (dict(prompt_ids="def main(", max_new_tokens=2), "prompt_ids"),                # text, not ids
    (dict(prompt_ids=PROMPT, max_new_tokens=2, seed=-1), "seed"),
    (dict(prompt_ids=PROMPT, max_new_tokens=2, seed=2 ** 31), "seed"),      # the domain of every seed
    (dict(prompt_ids=PROMPT, max_new_tokens=0, stop_at_eod="false"), "stop_at_eod"),   # a string reads as true
    (dict(prompt_ids=np.zeros((0, 3), np.int32), max_new_tokens=2), "prompt_ids"),   # a batch of none
    (dict(prompt_ids=PROMPT, max_new_tokens=2, temperature=True), "temperature"),     # a bool, as top_k's
    (dict(prompt_ids=PROMPT, max_new_tokens=2, top_p=True), "top_p"),
    (dict(prompt_ids=PROMPT, max_new_tokens=2, temperature=1e300), "temperature"),   # inf in fp32
    (dict(prompt_ids=PROMPT, max_new_tokens=2, temperature=1e-40, seed=1), "temperature"),   # 0 (as the flag's)
    (dict(prompt_ids=PROMPT, max_new_tokens=2, top_p=1e-50), "top_p"),                       # 0 in fp32
])
def test_bad_arguments_name_the_parameter(models, call, key):
    with pytest.raises(ConfigError) as e:
        models("gpt").generate(**call)
    assert e.value.key == key


def test_a_rotary_model_generates_at_another_sequence_length(models):
    """llama has no position table: loaded with a longer model.seq_len it computes the same logits
    and generates past the saved length; GPT's learned table is refused in one line."""
    saved, longer = models("llama"), models("llama", overrides=["model.seq_len=40"])
    prompt = [3, 1, 4, 1, 5]
    np.testing.assert_allclose(longer.logits([prompt]), saved.logits([prompt]), rtol=1e-6, atol=1e-6)
    assert len(longer.generate(prompt, max_new_tokens=30)) == 30 and len(prompt) + 30 > saved.seq_len
    with pytest.raises(ConfigError, match="model.seq_len: is 16 in the checkpoint's model, given 40"):
        models("gpt", overrides=["model.seq_len=40"])


def test_logits_are_fp32_whatever_the_precision(models):
    """A bf16 run's head computes in bf16: `.logits` returned ml_dtypes' bfloat16 array, not the
    fp32 [B, s, V] it promises; the values are the bf16 ones, widened."""
    logits = models("gpt", overrides=["train.precision=bf16"]).logits([PROMPT])
    assert logits.dtype == np.float32 and logits.shape == (1, 3, VOCAB)
    fp32 = models("gpt").logits([PROMPT])
    assert np.abs(logits - fp32).max() <= 0.02 * np.abs(fp32).max()       # bf16's rounding


def test_logits_of_ragged_rows_and_overrides_as_one_string_are_refused(models, checkpoints):
    with pytest.raises(ConfigError, match="rows of different lengths") as e:
        models("gpt").logits([[1, 2], [3]])
    assert e.value.key == "tokens"
    with pytest.raises(ConfigError, match="must be True or False") as e:
        models("gpt").logits([[1, 2]], document_masking="false")
    assert e.value.key == "document_masking"
    with pytest.raises(TypeError, match="overrides is a list"):
        mtjax.load(str(checkpoints["gpt"]), overrides="parallel.tensor=1")
    with pytest.raises(TypeError, match=r"overrides\[1\] is the int 1"):
        mtjax.load(str(checkpoints["gpt"]), overrides=["parallel.tensor=1", 1])
    with pytest.raises(TypeError, match="checkpoint is a directory's path, got int"):
        mtjax.load(5)
    with pytest.raises(ConfigError, match="^checkpoint: must name a directory"):   # was the cwd's 'no checkpoint'
        mtjax.load(" ")


# ----------------------------------------------------------------- the command line

def generate_cli(args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-m", "mtjax.generate", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def snapshot(root):
    return sorted((os.path.relpath(os.path.join(d, n), root), os.lstat(os.path.join(d, n)).st_mtime_ns)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def test_cli_continues_a_text_prompt_and_refuses_bad_input_in_one_line(models, checkpoints, tmp_path):
    run = str(checkpoints["llama"])
    before = snapshot(run)
    cases = [  # (arguments, the error line's start; None: succeeds)
        (["--prompt", "hi", "--max-new-tokens", "6", "--json", "--cpu-devices", "4", "parallel.pipe=2",
          "parallel.tensor=2"], None),
        (["--prompt-ids", "1,2,3", "--max-new-tokens", "14"], "error: --max-new-tokens:"),
        (["--prompt-ids", "1,x,3"], "error: --prompt-ids:"),
        (["--prompt-ids", f"1,{VOCAB}"], "error: --prompt-ids:"),
        (["--prompt-ids", "1", "parallel.tensor=2"], "error: parallel.tensor:"),
    ]
    argv = [["--checkpoint", run, *args] for args, _ in cases]
    argv.append(["--checkpoint", str(tmp_path / "nope"), "--prompt", "a"])
    expect = [error for _, error in cases] + [f"error: {tmp_path / 'nope'}: no such directory"]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(generate_cli, argv))
    for args, error, r in zip(argv, expect, results):
        if error is None:
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["prompt_ids"] == list(b"hi") and out["ids"] == models("llama").generate(list(b"hi"), 6)
            assert out["text"] == bytes(i for i in out["ids"] if i < 256).decode("utf-8", "replace")
        else:
            assert r.returncode == 2, (args, r.stdout, r.stderr)
            assert r.stderr.count("\n") == 1 and r.stderr.startswith(error), (args, r.stderr)
            assert r.stdout == ""
    assert snapshot(run) == before and not os.path.exists(tmp_path / "nope")


def test_cli_defaults_fit_the_room_left_and_top_k_beyond_the_vocabulary_is_no_filter(models, checkpoints, capsys):
    """Without --max-new-tokens the continuation takes the room the prompt leaves (up to 32); a
    prompt that leaves none is refused naming the prompt, never the flag not given. --top-k at or
    beyond V (up to int32) samples as no filter does; in the API too, beyond int32."""
    from mtjax import cli
    from mtjax.generate import main

    def generate(*args):
        status = cli.report(main, ["--checkpoint", str(checkpoints["gpt"]), "--json", *args])
        out = capsys.readouterr()
        return status, out.out, out.err.splitlines()

    model = models("gpt")
    status, out, err = generate("--prompt-ids", "5,17,42")
    assert status == 0 and err == [] and json.loads(out)["ids"] == model.generate(PROMPT, model.seq_len - len(PROMPT))
    status, out, err = generate("--prompt-ids", ",".join(["7"] * model.seq_len))
    assert status == 2 and out == "" and len(err) == 1 and err[0].startswith("error: --prompt-ids: "), err
    assert "--max-new-tokens" not in err[0]
    sampled = ["--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3"]
    unfiltered = model.generate(PROMPT, 6, temperature=1.0, seed=3)
    for k in (str(VOCAB), "2147483647"):
        status, out, err = generate(*sampled, "--top-k", k)
        assert status == 0 and json.loads(out)["ids"] == unfiltered, (k, err)
    assert model.generate(PROMPT, 6, temperature=1.0, top_k=5_000_000_000, seed=3) == unfiltered
    assert unfiltered != model.generate(PROMPT, 6)          # sampled: a filter would show (top_k=1 is greedy)


# ----------------------------------------------------------------- any mesh

LAYOUTS = {"data2": ["parallel.data=2"], "pipe2": ["parallel.pipe=2"],
           "pipe2_tensor2": ["parallel.pipe=2", "parallel.tensor=2"],
           "data2_pipe2_tensor2": ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2"]}
BATCH = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9], [7], [3, 3, 250]]      # lengths 3, 9, 1, 3


# Each layout once, the architectures alternating; the cut cases were the other architecture on
# the same layout (the architectures differ in the layers, which the one-device model runs too).
@pytest.mark.parametrize("arch,layout", [("llama", "data2"), ("gpt", "pipe2"), ("llama", "pipe2_tensor2"),
                                         ("gpt", "data2_pipe2_tensor2")])
def test_generation_on_data_pipe_and_tensor_equals_one_device(models, arch, layout):
    """Rows split over `data`, layers over `pipe` (pipelined over groups of rows), heads over
    `tensor`: greedy tokens are the one device's, and so are tokens sampled with a seed."""
    model, one = models(arch, overrides=LAYOUTS[layout]), models(arch)
    assert model.generate(BATCH, 4) == one.generate(BATCH, 4)
    sampled = dict(temperature=1.0, seed=7)
    assert model.generate(BATCH, 4, **sampled) == one.generate(BATCH, 4, **sampled)


def test_opening_a_checkpoint_to_generate_builds_nothing_of_training(checkpoints):
    """A fresh process that loads a checkpoint and generates imports no optimizer, no training
    step or Trainer and no pipeline executor."""
    code = ("import sys, mtjax; mtjax.load(sys.argv[1]).generate([5, 17, 42], 2); "
            "print([m for m in ('optax', 'mtjax.training.step', 'mtjax.training.trainer', "
            "'mtjax.pipeline.executor') if m in sys.modules])")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([REPO, env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code, str(checkpoints["gpt"])], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_bad_layouts_and_batches_are_one_line(checkpoints, capsys):
    """A batch smaller than parallel.data, a prompt longer than model.seq_len, a pipe that does
    not divide the layers, a parallel option generation does not take, a model field other than
    the checkpoint's (a shape, or the function): one line, status 2."""
    from mtjax import cli
    from mtjax.generate import main
    cases = [(["--prompt-ids", "1,2", "parallel.data=2"], "error: --prompt-ids: a batch of 1 prompt cannot be split"),
             (["--prompt-ids", ",".join(["7"] * 17), "--max-new-tokens", "1"],
              "error: --prompt-ids: a prompt of 17 tokens is longer than model.seq_len 16"),
             (["--prompt-ids", "1", "parallel.pipe=3"], "error: parallel.pipe: num_layers 2 is not divisible"),
             (["--prompt-ids", "1", "parallel.schedule=zbv"], "error: parallel.schedule: generation takes only"),
             (["--prompt-ids", "1", "model.num_layers=4"], "error: model.num_layers: is 2 in the checkpoint's model"),
             (["--prompt-ids", "1", "model.norm_eps=0.1"], "error: model.norm_eps: is 1e-05 in the checkpoint's model")]
    for args, error in cases:
        status = cli.report(main, ["--checkpoint", str(checkpoints["gpt"]), *args])
        out = capsys.readouterr()
        assert status == 2 and out.out == "" and out.err.count("\n") == 1, (args, out.err)
        assert out.err.startswith(error), (args, out.err)
    with pytest.raises(ConfigError) as e:
        mtjax.load(str(checkpoints["gpt"]), overrides=["parallel.data=2"]).generate([PROMPT], 2)
    assert e.value.key == "prompt_ids"


def test_the_tokenizer_is_the_runs_with_its_named_tokens(checkpoints):
    """`model.tokenizer` is the run's `data` group: `data.eod_token` and `data.bos_token` name its
    end- and beginning-of-document tokens (stop_at_eod and packed logits read them), not the
    tokenizer file's defaults."""
    from tokenizer_fixture import FIXTURE
    from mtjax.data.tokenizer import load_tokenizer
    plain = load_tokenizer(FIXTURE)
    override = [f"data.tokenizer={FIXTURE}", "data.eod_token=<|begin_of_text|>", "data.bos_token=<|end_of_text|>"]
    named = mtjax.load(str(checkpoints["gpt"]), overrides=override).tokenizer
    assert (named.eod_id, named.bos_id) == (plain.bos_id, plain.eod_id) and plain.eod_id != plain.bos_id
    with pytest.raises(ConfigError, match="data.eod_token"):
        mtjax.load(str(checkpoints["gpt"]), overrides=[f"data.tokenizer={FIXTURE}", "data.eod_token=<nope>"]).tokenizer


def test_a_mesh_with_a_context_axis_is_refused(checkpoints):
    """Inference splits data, pipe and tensor: a mesh with context > 1 is refused at load, in one
    line (it was accepted, and `.logits` failed inside XLA); so is a mesh without those axes."""
    mesh = make_mesh(1, 1, 1, jax.devices()[:2], context=2)
    with pytest.raises(ConfigError, match="context=2: inference splits data, pipe and tensor only"):
        mtjax.load(str(checkpoints["gpt"]), mesh)
    with pytest.raises(ConfigError, match="parallel.context"):
        mtjax.load(str(checkpoints["gpt"]), overrides=["parallel.context=2"])
    # a mesh not made by make_mesh: a bare KeyError 'data' (or AttributeError), now one line naming it
    with pytest.raises(ConfigError, match=r"mesh: has axes \('x',\), not data, pipe and tensor"):
        mtjax.load(str(checkpoints["gpt"]), jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))
    with pytest.raises(TypeError, match="mesh is a jax.sharding.Mesh .*got list"):
        mtjax.load(str(checkpoints["gpt"]), jax.devices()[:2])
    with pytest.raises(ConfigError, match="^mesh: holds a device twice"):   # was orbax's error, and its tracebacks
        mtjax.load(str(checkpoints["gpt"]), make_mesh(2, 1, 1, jax.devices()[:1] * 2))


def test_a_mixture_of_experts_trained_with_a_capacity_generates_dropless(tmp_path):
    """A capacity counts a sequence's tokens: the prompt's padding would take slots, and a
    one-token decode step never drops. Generation routes every token, so the cache path picks
    what decoding without a cache picks (it did not at capacity 1.0), and a capacity given
    to `load` is refused."""
    cfg = tiny_config("llama", extra=["model.init_std=0.2", f"train.run_dir={tmp_path}", "checkpoint.async_save=false",
                                      "model.num_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=1.0"])
    trainer = Trainer(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), VOCAB)
    checkpointer = Checkpointer(cfg)
    checkpointer.save(trainer.init_state(), trainer)
    checkpointer.close()
    model = mtjax.load(str(tmp_path))
    assert model.cfg.model.moe_capacity_factor == 0.0
    assert model.generate(PROMPT, NEW) == greedy_without_cache(model, PROMPT, NEW)
    with pytest.raises(ConfigError, match="dropless") as e:
        mtjax.load(str(tmp_path), overrides=["model.moe_capacity_factor=1.0"])
    assert e.value.key == "model.moe_capacity_factor"


def test_a_loaded_model_says_what_it_is(models):
    """repr: the checkpoint's step, the model's shape and the mesh it runs on (not Python's default)."""
    one, split = repr(models("llama")), repr(models("llama", 2))
    assert one.startswith("InferenceModel(step 0: llama, ") and one.endswith("; one device)")
    assert "vocab " in one and "seq_len 16" in one and split.endswith("; tensor 2)")
