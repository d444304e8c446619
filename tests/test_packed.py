"""Packed rows (`data.document_masking`): a row of several documents computes what each document
computes alone.

The oracle is each document run alone through tests/reference.py: the per-token losses (from the
logits) and the gradients of the row's loss equal those of the documents, fp32 at 1e-5; the loss
is the mean over the loss-carrying labels of the global batch (`training/packing.py`: the label
after an end-of-document input carries none; the label EOD itself does). One layout per case
(not a cross product; several to a case, to compile fewer steps): one device; data 2 with the
distributed optimizer, tensor 2 + SP, the `jax.nn.dot_product_attention` kernel and full
recomputation; pipe 2 with 1f1b and context 2 with the ring; pipe 2 with zb and context 2 with
all_gather under selective recomputation; the 2d tensor grid (dot_product, selective recomputation)
and the 2.5d grid (full recomputation); GPT (learned positions, MHA, tied head) and Llama (RoPE,
GQA, untied head).
zbv, interleaving and the tensor-parallel overlap were checked the same way once, not kept.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from layouts import BATCH, SEQ, VOCAB, ZERO_GRADIENT, leaf_errors, relative, tiny_config
from mtjax.layout import logits_fn
from mtjax.mesh import make_mesh
from mtjax.model.documents import find_documents
from mtjax.training.packing import NO_LOSS
from mtjax.training.trainer import Trainer

TOL = 1e-5
EOD = 7

# where each row's EODs sit among its s + 1 tokens: several documents, a leading fragment, an EOD
# as the first token, two EODs in a row, an EOD as the last input (its label the next row's
# start), one as the last label, and a row of one document
EOD_AT = [(3, 9), (0, 5, 6), (15,), (16,), (), (1, 14), (7,), (2, 4, 8, 12)]


def packed_batch(seed=0):
    rows = np.random.RandomState(seed).randint(0, VOCAB - 1, (BATCH, SEQ + 1))
    rows[rows >= EOD] += 1                        # no EOD but where placed
    for r, at in enumerate(EOD_AT):
        rows[r, list(at)] = EOD
    return rows.astype(np.int32)


def documents_of(row):
    """[(start, end)] of the documents of a row's inputs: each ends at an EOD (inclusive)."""
    spans, start = [], 0
    for i, x in enumerate(row[:-1]):
        if x == EOD:
            spans.append((start, i + 1))
            start = i + 1
    return spans + ([(start, SEQ)] if start < SEQ else [])


def oracle(cfg, batch):
    """params -> ((loss, per-token losses [B, s]), gradients): every document alone, each a row
    of its own starting at position 0 and right-padded (causal: the padding is never seen), one
    call of the reference on all of them."""
    spans = [(r, a, b) for r, row in enumerate(batch) for a, b in documents_of(row)]
    ids = batch & (NO_LOSS - 1)
    alone = np.zeros((len(spans), SEQ + 1), np.int32)
    for k, (r, a, b) in enumerate(spans):
        alone[k, :b - a + 1] = ids[r, a:b + 1]
    weights = np.where(batch[:, :-1] == EOD, 0.0, 1.0) * ((batch[:, 1:] & NO_LOSS) == 0)
    # where each token of the batch sits among the documents' rows
    where = np.zeros((BATCH, SEQ, 2), np.int32)
    for k, (r, a, b) in enumerate(spans):
        where[r, a:b] = np.stack([np.full(b - a, k), np.arange(b - a)], -1)

    def loss(params):
        z = reference.logits(params, jnp.asarray(alone[:, :-1]), cfg.model, VOCAB)          # [n, s, V]
        each = -jnp.take_along_axis(jax.nn.log_softmax(z, -1), jnp.asarray(alone[:, 1:, None]), -1)[..., 0]
        token_losses = each[where[..., 0], where[..., 1]]                                # [B, s]
        return jnp.sum(token_losses * weights) / np.sum(weights), token_losses
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def test_find_documents():
    docs = find_documents(jnp.asarray([[1, EOD, 2, 3, EOD, EOD, 4]]), EOD)
    assert docs.segments.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0, 0]]


CASES = [  # (arch, data, pipe, tensor, context, extra overrides): each layout once, combined
    ("gpt", 1, 1, 1, 1, ()),
    # FSDP's own layer scan (`model/fsdp_scan.py`) hands each layer the segment ids
    ("llama", 2, 1, 2, 1, ("parallel.sequence_parallel=true", "model.attention=dot_product",
                           "parallel.fsdp=true", "train.recompute=full")),
    ("gpt", 1, 2, 1, 2, ("parallel.schedule=1f1b", "parallel.context_attention=ring")),
    ("llama", 1, 2, 1, 2, ("parallel.schedule=zb", "parallel.context_attention=all_gather",
                           "train.recompute=selective")),
    # the tensor grid: the stream's rows of the segment ids and positions (ROW, and DEPTH at 2.5d),
    # the loss weights on the logits' rows (COL under GPT's tied head, ROW under Llama's)
    ("gpt", 1, 1, 4, 1, ("parallel.tensor_grid=2d", "model.attention=dot_product", "train.recompute=selective")),
    ("llama", 1, 1, 8, 1, ("parallel.tensor_grid=2.5d", "parallel.tensor_depth=2", "train.micro_batch=4",
                           "train.recompute=full")),
]


@pytest.fixture(scope="module")
def oracles():
    made = {}

    def get(arch, cfg, batch):
        if arch not in made:
            made[arch] = oracle(cfg, batch)
        return made[arch]
    return get


@pytest.mark.parametrize("arch,data,pipe,tensor,context,extra", CASES)
def test_packed_rows_match_each_document_alone(oracles, arch, data, pipe, tensor, context, extra):
    cfg = tiny_config(arch, tensor, pipe, data, micro_batch=2,
                      extra=("data.document_masking=true", f"parallel.context={context}", *extra))
    trainer = build_packed(cfg, data, pipe, tensor, context)
    batch = packed_batch()
    state = trainer.init_state()
    params = jax.device_get(trainer.canonical(state.params))
    (ref_loss, ref_token_losses), ref_grads = oracles(arch, cfg, batch)(params)

    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(jnp.asarray(batch)), state.rng)
    assert abs(float(loss) - float(ref_loss)) < TOL * float(ref_loss)
    errs = leaf_errors(jax.device_get(trainer.canonical(grads)), ref_grads, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    if pipe * context * data == 1 and (tensor == 1 or "parallel.tensor_grid=2d" in extra):
        # the per-token losses, from the packed logits (one device, and the grid's own logits)
        logits = logits_fn(trainer.layout, EOD)(state.params, trainer.put_batch(jnp.asarray(batch[:, :-1])))
        token_losses = -jnp.take_along_axis(jax.nn.log_softmax(jnp.asarray(logits), -1),
                                            jnp.asarray(batch[:, 1:, None]), -1)[..., 0]
        assert relative(token_losses, ref_token_losses) < TOL


@pytest.mark.parametrize("arch,tensor,kernel", [("llama", 2, "xla"), ("gpt", 1, "dot_product")])
def test_bf16_documents_never_see_each_other(arch, tensor, kernel):
    """bf16 (Llama on tensor 2 + SP with the einsums; GPT on one device with
    `jax.nn.dot_product_attention`): changing the tokens of each row's first document leaves the
    logits of every later document bitwise unchanged (the packed forward of training, through
    `logits_fn` with the end-of-document id, as `mtjax.load(...).logits(document_masking=True)`). The mask gives the other documents' keys a
    probability of exactly 0, in any precision; no tolerance is needed, so none is taken."""
    cfg = tiny_config(arch, tensor, sp=tensor > 1, extra=("data.document_masking=true", "train.precision=bf16",
                                                          f"model.attention={kernel}"))
    trainer = build_packed(cfg, 1, 1, tensor, 1)
    state = trainer.init_state()
    batch = packed_batch()[:, :-1]
    changed = batch.copy()
    for r, row in enumerate(batch):
        (a, b), *later = documents_of(np.append(row, 0))
        changed[r, a:b - 1] = (row[a:b - 1] + 1 + (row[a:b - 1] + 1 >= EOD)) % VOCAB     # no new EOD
    logits = logits_fn(trainer.layout, EOD)
    before = np.asarray(logits(state.params, trainer.put_batch(jnp.asarray(batch))), np.float32)
    after = np.asarray(logits(state.params, trainer.put_batch(jnp.asarray(changed))), np.float32)
    compared = 0
    for r, row in enumerate(batch):
        first_end = documents_of(np.append(row, 0))[0][1]
        assert not np.array_equal(before[r, :first_end - 1], after[r, :first_end - 1]) or first_end <= 1
        np.testing.assert_array_equal(after[r, first_end:], before[r, first_end:], err_msg=f"row {r}")
        compared += SEQ - first_end
    assert compared > SEQ      # several rows hold later documents


def build_packed(cfg, data, pipe, tensor, context):
    mesh = make_mesh(data, pipe, tensor, jax.devices()[: data * pipe * context * tensor], context=context)
    return Trainer(cfg, mesh, VOCAB, eod=EOD)


def test_packed_row_gives_transformers_logits_of_each_document_alone(tmp_path):
    """A tiny random HF Llama (GQA, Llama 3.1 rotary scaling; tests/fixtures/hf, logits computed by
    transformers) converted into mtjax: on packed rows, `logits(..., document_masking=True)` gives
    each document the logits transformers gave it alone (a prefix of a fixture row: causal, so
    transformers' logits there are the prefix's own), 1e-4."""
    import mtjax
    from safetensors.numpy import load_file
    from mtjax.commands.convert_hf import from_hf
    fixture = "tests/fixtures/hf/llama"
    from_hf(fixture, str(tmp_path / "mtjax"))
    expected = load_file(f"{fixture}/expected.safetensors")
    ids, logits = expected["input_ids"], expected["logits"]        # [2, 64], [2, 64, V]
    eod = int(ids[0, 20])                                            # first seen at position 20 of row 0
    assert eod not in ids[0, :20] and eod not in ids[1, :22]
    # (fixture row, prefix length): every document but a row's last ends with eod
    docs = [[(0, 21), (0, 21), (1, 22)], [(0, 21), (0, 21), (0, 21), (1, 1)]]
    packed = np.stack([np.concatenate([ids[r, :n] for r, n in row]) for row in docs])
    want = np.stack([np.concatenate([logits[r, :n] for r, n in row]) for row in docs])
    got = mtjax.load(str(tmp_path / "mtjax")).logits(packed, document_masking=True, eod_id=eod)
    assert float(np.abs(got - want).max()) < 1e-4


def test_label_weights_and_the_settings_that_refuse():
    """Which labels carry loss (`packing.label_weights`), with and without document masking, and
    the settings validation refuses. No compiled step."""
    from types import SimpleNamespace
    from mtjax.config.errors import ConfigError
    from mtjax.config.validate import validate
    from mtjax.training.packing import label_weights
    rows = jnp.asarray([[1, EOD, 2, 3 | NO_LOSS, EOD, 4]])
    for masking, eod_loss in ((True, False), (False, True)):
        plan = SimpleNamespace(masks_loss=True, eod=EOD, document_masking=masking, eod_mask_loss=eod_loss)
        # the label EOD is trained; none after an EOD input; none on a NO_LOSS label
        assert label_weights(rows, plan).tolist() == [[1, 0, 0, 1, 0]]
    assert label_weights(rows, SimpleNamespace(masks_loss=False)) is None
    with pytest.raises(ConfigError, match="data.eod_mask_loss.*no effect"):
        validate(tiny_config(extra=("data.document_masking=true", "data.eod_mask_loss=true")), 1)
    validate(tiny_config("gpt", 4, extra=("data.document_masking=true", "parallel.tensor_grid=2d")), 4)


def test_validation_weighs_each_batch_by_its_loss_carrying_labels():
    """`loop.evaluate` over batches holding different counts of loss-carrying labels: val_loss is
    the mean over all their labels, sum_j N_j L_j / sum_j N_j (as the training loss weighs rows),
    not the mean of the batches' means."""
    from mtjax.training.data_setup import ValidSet
    from mtjax.training.loop import evaluate
    cfg = tiny_config(extra=("data.document_masking=true", "train.eval_batches=2"))
    rows = packed_batch(0)
    rows[:, :12] |= NO_LOSS                       # batch 0: only the rows' last labels carry loss
    rows = np.concatenate([rows, packed_batch(1)])
    trainer = Trainer(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), VOCAB, eod=EOD)
    params = trainer.init_state().params
    losses = [float(trainer.eval_step(params, trainer.put_batch(rows[j * BATCH:(j + 1) * BATCH]))) for j in (0, 1)]
    counts = []
    for batch in (rows[:BATCH], rows[BATCH:]):
        ids = batch & (NO_LOSS - 1)
        counts.append(int((((batch[:, 1:] & NO_LOSS) == 0) & (ids[:, :-1] != EOD)).sum()))
    assert counts[0] < counts[1] // 2
    got = evaluate(trainer, params, [ValidSet("", 1.0, list(rows))], cfg)["val_loss"]
    want = (counts[0] * losses[0] + counts[1] * losses[1]) / sum(counts)
    assert got == pytest.approx(want, rel=1e-6)
    assert abs(got - np.mean(losses)) > 1e-4
