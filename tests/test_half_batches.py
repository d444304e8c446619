"""Half-batch overlap (`parallel.half_batch_overlap`, `mtjax/parallel/half_batches.py`).

- A toy sequence-parallel layer (gather, two matmuls, reduce-scatter) on a 2-rank `tensor` mesh:
  `split_layer` gives each half's value and the gradients of x and the weights, and its forward
  and backward programs are windows of one collective each, fenced, that hold the other half's
  matmuls (the jaxprs are read: nothing compiles for that).
- Equality with one device (tests/reference.py, fp32, 1e-5): logits, loss, every gradient leaf,
  one AdamW step, Llama (MQA: k = 1 < t = 2) at data 2 with FSDP and t = 2 with sequence parallelism and selective
  recomputation, and GPT at t = 2 without it (its all-reduces are the collectives). (Checked by
  hand, not here for the suite's time: data 2 + ZeRO-1 under 1F1B, full recomputation, t = 4 with
  replicated kv heads, context 2 with either attention, with `tensor_overlap`; FSDP with its
  gathered layers kept, under 1F1B gathering per micro-batch, and with context 2.) Mixture of
  experts: tests/test_moe.py's context case runs the halves.
- Packed rows (per-row rotary tables and document ids split with the halves), against each
  document alone (tests/test_packed.py's oracle).
- Layers in groups (`parallel.half_batch_group`): two toy layers as one unit leave one layer's lone
  collectives, not two layers'; the GPT case above runs its two layers as one unit.
- Sequence halves (`parallel.half_batch_axis=sequence`): the stream's layout under sequence
  parallelism, the second half's attention against the whole sequence's (values and gradients),
  and equality with one device at b = 1 (data 2 + ZeRO-1 selective, pipe 2 full recomputation,
  t = 4 with `tensor_overlap` and two layers a unit) and at b = 2 without sequence parallelism.
- Bad input: one line naming the field, at the config level.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core    # jaxprs_in_params: the jaxprs nested in an equation
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from layouts import build, tiny_config
from mtjax.config import ConfigError, load_config, validate
from mtjax.mesh import TENSOR
from mtjax.model.core_attention import einsum_attention
from mtjax.model.prefix_attention import prefixed_attention
from mtjax.parallel.half_batches import COLLECTIVES, split_layer
from mtjax.parallel.sequence_halves import in_position_order, stream_order
from test_equivalence import assert_matches_reference, relative
from test_packed import oracles  # noqa: F401 (a fixture)
from test_packed import test_packed_rows_match_each_document_alone as packed_rows_match   # not collected here

TOL = 1e-5
FLAG = "parallel.half_batch_overlap=true"


# ---------------------------------------------------------------- the operator on a toy layer
def _layer(x, rest, shared):
    """x [b, n, h] (this rank's rows) -> [b, n, h]: gather, tanh(X W1) W2 by columns then rows,
    reduce-scatter, residual; `rest` scales the input (a per-half leaf without a gradient)."""
    w1, w2 = shared
    full = lax.all_gather(x * rest, TENSOR, axis=1, tiled=True)                  # [b, s, h]
    y = jnp.tanh(jnp.einsum("bsh,hf->bsf", full, w1)) @ w2                       # [b, s, h] partial
    return x + lax.psum_scatter(y, TENSOR, scatter_dimension=1, tiled=True)      # [b, n, h]


def _passing_nothing(layer):
    """layer(x, rest, shared) as `split_layer` takes it: (y, what it passes to the other half)."""
    return lambda x, rest, shared, passed: (layer(x, rest, shared), None)


def _toy():
    mesh = Mesh(np.array(jax.devices()[:2]), (TENSOR,))
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(4, 8, 6), jnp.float32)                             # [b, s, h], s over 2 ranks
    w1 = jnp.asarray(rng.randn(6, 10) * 0.3, jnp.float32)                        # [h, f/t] per rank: f = 20
    w2 = jnp.asarray(rng.randn(10, 6) * 0.3, jnp.float32)
    specs = (P(None, TENSOR), P(None, TENSOR), P(TENSOR, None))
    return mesh, specs, (x, jnp.tile(w1, (1, 2)), jnp.tile(w2, (2, 1)))


def _loss(paired: bool):
    """sum of squares of the layer's output on x, the batch halved (paired) or whole."""
    def local(x, w1, w2):
        scale = jnp.float32(0.5)
        if paired:
            ya, yb = split_layer(_passing_nothing(_layer))((x[:2], scale), (x[2:], scale), (w1, w2))
            y = jnp.concatenate([ya, yb])
        else:
            y = _layer(x, scale, (w1, w2))
        return lax.psum(jnp.sum(y ** 2), TENSOR)
    return local


def _sharded(fn, mesh, specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)


def test_split_layer_gives_each_halfs_value_and_gradients():
    mesh, specs, args = _toy()
    want = jax.jit(jax.value_and_grad(_sharded(_loss(False), mesh, specs), argnums=(0, 1, 2)))(*args)
    got = jax.jit(jax.value_and_grad(_sharded(_loss(True), mesh, specs), argnums=(0, 1, 2)))(*args)
    assert relative(got[0], want[0]) < TOL
    for g, w in zip(got[1], want[1]):
        assert relative(g, w) < TOL


def _windows(jaxpr) -> list[list]:
    """The equations between each fence on a window's inputs and the fence on its outputs (the
    fences come in pairs)."""
    eqns = jaxpr.eqns
    fences = [i for i, e in enumerate(eqns) if e.primitive is lax.optimization_barrier_p]
    assert fences and len(fences) % 2 == 0, len(fences)
    return [eqns[a + 1:b] for a, b in zip(fences[::2], fences[1::2])]


def test_each_window_holds_one_collective_and_the_other_halfs_matmuls():
    mesh, specs, args = _toy()
    for program in (_sharded(_loss(True), mesh, specs),                           # the forward
                    jax.grad(_sharded(_loss(True), mesh, specs), argnums=(0, 1, 2))):   # and the backward
        top = jax.make_jaxpr(program)(*args).jaxpr
        windows = _windows(next(j for e in top.eqns if (j := _find_fenced(e)) is not None))
        names = [[e.primitive.name for e in w] for w in windows]
        assert all(sum(n in COLLECTIVES for n in w) <= 1 for w in names), names
        paired = [w for w in names if sum(n in COLLECTIVES for n in w) == 1 and "dot_general" in w]
        assert len(paired) >= 2, names


def test_a_group_of_layers_has_the_lone_windows_of_one():
    """Two toy layers interleaved as one unit (`parallel.half_batch_group`): the halves' windows
    cross the layer boundary, so the forward leaves the two collectives of one layer outside a
    window with the other half's matmuls (A's first gather, B's last reduce-scatter), not four."""
    mesh, specs, args = _toy()

    def two(x, rest, shared):
        return _layer(_layer(x, rest, shared), rest, shared)

    def forward(layer):
        def local(x, w1, w2):
            ya, yb = split_layer(_passing_nothing(layer))((x[:2], jnp.float32(0.5)), (x[2:], jnp.float32(0.5)), (w1, w2))
            return lax.psum(jnp.sum(ya ** 2) + jnp.sum(yb ** 2), TENSOR)
        top = jax.make_jaxpr(_sharded(local, mesh, specs))(*args).jaxpr
        fenced = next(j for e in top.eqns if (j := _find_fenced(e)) is not None)
        names = [[e.primitive.name for e in w] for w in _windows(fenced)]
        paired = [w for w in names if any(n in COLLECTIVES for n in w) and "dot_general" in w]
        every = sum(e.primitive.name in COLLECTIVES for e in fenced.eqns)
        return every - len(paired), len(paired)      # (collectives outside a paired window, paired windows)
    (alone_1, paired_1), (alone_2, paired_2) = forward(_layer), forward(two)
    assert alone_2 == alone_1 == 2 and paired_2 == 2 * paired_1 + 2, (alone_1, paired_1, alone_2, paired_2)


def _find_fenced(eqn):
    """The jaxpr inside `eqn` (through calls) that holds the fences."""
    for j in core.jaxprs_in_params(eqn.params):
        if any(e.primitive is lax.optimization_barrier_p for e in j.eqns):
            return j
        for e in j.eqns:
            found = _find_fenced(e)
            if found is not None:
                return found
    return None


# ---------------------------------------------------------------- equality with one device
CASES = [  # (arch, data, pipe, tensor, sequence parallel, extra)
    # FSDP's own layer scan (`model/fsdp_scan.py`) runs the halves, each layer gathered alone; MQA
    # (k = 1 < t = 2): the gathered, replicated K and V kernels sliced to the rank's head
    ("llama", 2, 1, 2, True, ["train.recompute=selective", "parallel.fsdp=true", "model.num_kv_heads=1"]),
    ("gpt", 1, 1, 2, False, ["parallel.half_batch_group=2"]),     # its two layers as one unit
]


@pytest.mark.parametrize("arch,data,pipe,tensor,sp,extra", CASES,
                         ids=[f"{c[0]}-d{c[1]}p{c[2]}t{c[3]}{'-sp' if c[4] else ''}" for c in CASES])
def test_half_batches_match_reference(arch, data, pipe, tensor, sp, extra):
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=2, extra=[FLAG, *extra])
    trainer = build(cfg, data, pipe, tensor)
    ref_loss, metrics = assert_matches_reference(trainer, cfg)
    assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL


def test_packed_rows_split_with_their_rotary_tables(oracles):
    """Packed rows: each half takes its rows' document ids and per-row rotary tables [b, s, d/2]
    (Llama, data 2 + ZeRO-1, t = 2 + SP, full recomputation), against each document alone."""
    packed_rows_match(
        oracles, "llama", 2, 1, 2, 1, ("parallel.sequence_parallel=true", "model.attention=dot_product",
                                       "parallel.distributed_optimizer=true", "train.recompute=full", FLAG))


# ---------------------------------------------------------------- sequence halves
SEQUENCE = "parallel.half_batch_axis=sequence"


def test_the_stream_order_gathers_each_half_in_position_order():
    """Rank r's rows of the stream are its rows of each half; gathered over `tensor` each half's
    rows are its positions in order, and `in_position_order` undoes the layout."""
    s, t = 24, 3
    order = stream_order(s, t)
    rows = order.reshape(t, 2, s // (2 * t))                       # [rank, half, row]
    assert (rows[:, 0].reshape(-1) == np.arange(s // 2)).all() and (rows[:, 1].reshape(-1) == np.arange(s // 2, s)).all()
    x = jnp.asarray(np.random.RandomState(0).randn(2, s, 5), jnp.float32)
    assert (in_position_order(x[:, order], t) == x).all()


def test_the_second_half_reads_the_first_halfs_keys_whole():
    """prefixed_attention(Q_B, K_B, V_B, K_A, V_A) is the causal attention of the whole sequence
    at the second half's rows, and its gradients are that attention's (K_A, V_A included)."""
    rng = np.random.RandomState(1)
    b, s, k, g, d = 2, 8, 2, 3, 4
    q = jnp.asarray(rng.randn(b, s, k, g, d), jnp.float32)
    kv = [jnp.asarray(rng.randn(b, s, k, d), jnp.float32) for _ in range(2)]
    n = s // 2
    weights = jnp.asarray(rng.randn(b, n, k, g, d), jnp.float32)

    def whole(q, k, v):
        return jnp.sum(einsum_attention(q, k, v)[:, n:] * weights)

    def halves(q, k, v):
        return jnp.sum(prefixed_attention(q[:, n:], k[:, n:], v[:, n:], k[:, :n], v[:, :n], "xla") * weights)
    want, got = jax.value_and_grad(whole, (0, 1, 2))(q, *kv), jax.value_and_grad(halves, (0, 1, 2))(q, *kv)
    assert relative(got[0], want[0]) < TOL
    for g_, w_ in zip(got[1], want[1]):
        assert relative(g_, w_) < TOL


SEQUENCE_CASES = [  # (arch, data, pipe, tensor, sequence parallel, micro-batch, extra)
    ("llama", 2, 1, 2, True, 1, ["train.recompute=selective", "parallel.distributed_optimizer=true"]),
    ("llama", 1, 2, 2, True, 1, ["train.recompute=full"]),
    ("gpt", 1, 1, 4, True, 1, ["parallel.half_batch_group=2", "parallel.tensor_overlap=true"]),
    ("gpt", 1, 1, 2, False, 2, []),
]


@pytest.mark.parametrize("arch,data,pipe,tensor,sp,b,extra", SEQUENCE_CASES,
                         ids=[f"{c[0]}-d{c[1]}p{c[2]}t{c[3]}{'-sp' if c[4] else ''}-b{c[5]}" for c in SEQUENCE_CASES])
def test_sequence_halves_match_reference(arch, data, pipe, tensor, sp, b, extra):
    """The halves of the sequence (odd b included: b = 1): the second half's attention reads the
    first half's keys and values; with sequence parallelism the stream in `stream_order`."""
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=b, extra=[FLAG, SEQUENCE, *extra])
    trainer = build(cfg, data, pipe, tensor)
    ref_loss, metrics = assert_matches_reference(trainer, cfg)
    assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL


# ---------------------------------------------------------------- bad input
BATCH = ["train.global_batch=8"]


@pytest.mark.parametrize("overrides,devices,key,words", [
    (["train.micro_batch=1", "parallel.tensor=2"], 2, "train.micro_batch", "even micro-batch"),
    (["train.micro_batch=2"], 1, "parallel.half_batch_overlap", "parallel.tensor > 1"),
    (["train.micro_batch=2", "parallel.tensor=2", "train.offload_activations=true"], 2,
     "parallel.half_batch_overlap", "offload_activations"),
    (["train.micro_batch=2", "parallel.tensor=2", "parallel.pipe=2", "parallel.schedule=zb"], 4,
     "parallel.half_batch_overlap", "schedule=zb"),
    (["train.micro_batch=1", "parallel.tensor=2", SEQUENCE, "model.num_experts=4"], 2, "parallel.half_batch_axis",
     "mixture of experts"),
    (["train.micro_batch=1", "parallel.tensor=2", SEQUENCE, "parallel.context=2"], 4, "parallel.half_batch_axis",
     "context parallelism"),
    (["train.micro_batch=1", "parallel.tensor=2", SEQUENCE, "data.document_masking=true"], 2,
     "parallel.half_batch_axis", "packed rows"),
    (["train.micro_batch=1", "parallel.tensor=2", SEQUENCE, "model.attention_dropout=0.1"], 2,
     "parallel.half_batch_axis", "attention dropout"),
    (["train.micro_batch=1", "parallel.tensor=2", SEQUENCE, "parallel.sequence_parallel=true", "model.seq_len=6"], 2,
     "model.seq_len", "not divisible by 4"),
    (["train.micro_batch=2", "parallel.tensor=2", "parallel.half_batch_axis=rows"], 2, "parallel.half_batch_axis",
     "batch or sequence"),
], ids=["odd_micro_batch", "at_t1", "offload", "zb", "seq_moe", "seq_context", "seq_packed", "seq_attention_dropout",
        "seq_len", "axis_unknown"])
def test_half_batch_overlap_is_refused_in_one_line(overrides, devices, key, words):
    cfg = load_config(None, [*BATCH, FLAG, *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, devices)
    assert e.value.key == key and "\n" not in str(e.value), str(e.value)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides,words", [
    ([FLAG, "parallel.tensor=2", "parallel.half_batch_group=0"], "must be >= 1"),
    (["parallel.tensor=2", "parallel.half_batch_group=2"], "half_batch_overlap=true"),
    (["parallel.tensor=2", SEQUENCE], "half_batch_overlap=true"),
], ids=["zero", "without_the_flag", "axis_without_the_flag"])
def test_half_batch_group_and_axis_are_refused_in_one_line(overrides, words):
    cfg = load_config(None, [*BATCH, "train.micro_batch=2", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    key = "parallel.half_batch_axis" if SEQUENCE in overrides else "parallel.half_batch_group"
    assert e.value.key == key and "\n" not in str(e.value), str(e.value)
    assert words in str(e.value), str(e.value)
