"""Context parallelism (`parallel.context`): every row split over a `context` mesh axis in 2c
load-balanced chunks computes what one device computes.

Oracle: tests/reference.py (fp32, relative error < 1e-5): logits, loss, every gradient leaf and
one AdamW step. The cases cover both attention kinds, c in {2, 4}, c x tensor 2 + SP, c x pipe 2
(1f1b and zb), c x data 2 + the distributed optimizer (split over data x context), GPT and Llama
(GQA), recompute none, selective and full, tensor_overlap, each at least once (the ring keeps only Q, K, V, O
and its log-sum-exp in every mode: selective recomputes nothing more there); plus: c = 1 compiles to the
3-axis mesh's collectives, a checkpoint moves between context sizes, and bad input is one line.
"""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from layouts import VOCAB, build, random_batch, tiny_config
from mtjax.config import ConfigError, load_config, validate
from mtjax.mesh import DATA, PIPE, TENSOR
from mtjax.training.trainer import Trainer
from test_equivalence import assert_matches_reference

TOL = 1e-5

# Cut: GPT at c = 2 alone (every other GPT case runs its all-gather attention at c = 2 with more
# around it) and Llama on data 2 + the distributed optimizer with the ring (the state's split over
# data x context does not depend on the attention kind: the GPT data 2 case below; the ring:
# Llama's recompute=full and tensor 2 cases, GPT's zb case).
# YaRN with d = 8 and theta 100 over 300 original positions: the default betas' ramp runs over pairs
# 0 .. 4, so the four pairs get 0, 1/4, 1/2, 3/4 of the division by 4; cos, sin times 1 + ln(4)/10
YARN_ROPE = ["model.rope_scaling=yarn", "model.rope_scaling_factor=4", "model.rope_theta=100",
             "model.rope_original_positions=300", "model.kv_channels=8"]
CASES = [  # (arch, data, pipe, context, tensor, sp, kind, extra)
    ("llama", 1, 1, 2, 1, False, "ring", ["train.recompute=full"]),
    ("llama", 1, 1, 4, 1, False, "all_gather", ["train.recompute=full", "model.attention=dot_product"]),
    ("llama", 1, 1, 2, 2, True, "ring", YARN_ROPE),
    ("gpt", 1, 1, 2, 2, True, "all_gather", ["train.recompute=selective", "parallel.tensor_overlap=true"]),
    ("llama", 1, 2, 2, 1, False, "all_gather", ["parallel.schedule=1f1b", "train.micro_batches=2"]),
    ("gpt", 1, 2, 2, 1, False, "ring", ["parallel.schedule=zb", "train.micro_batches=2"]),
    ("gpt", 2, 1, 2, 1, False, "all_gather", ["parallel.distributed_optimizer=true", "train.micro_batches=2"]),
]


def context_config(arch, data, pipe, context, tensor, sp, kind, extra=(), micro_batch=1):
    extra = [f"parallel.context={context}", f"parallel.context_attention={kind}", *extra]
    if any(e.startswith("train.micro_batches") for e in extra):
        micro_batch = None      # the b that m makes (`tiny_config`)
    return tiny_config(arch, tensor, pipe, data, sp, micro_batch=micro_batch, extra=extra)


@pytest.mark.parametrize("arch,data,pipe,context,tensor,sp,kind,extra", CASES,
                         ids=["-".join(map(str, c[:7])) + ("-" + c[7][0].split(".")[-1] if c[7] else "")
                              for c in CASES])
def test_context_parallel_matches_reference(arch, data, pipe, context, tensor, sp, kind, extra):
    cfg = context_config(arch, data, pipe, context, tensor, sp, kind, extra)
    validate(cfg, data * pipe * context * tensor)
    trainer = build(cfg, data, pipe, tensor, context)
    assert trainer.plan.context == context
    assert_matches_reference(trainer, cfg, evaluate=True)

def _collectives(trainer):
    from mtjax.hlo_report import collective_report
    from mtjax.inspect import compile_train_step
    ops = collective_report(compile_train_step(trainer).as_text(), trainer.mesh)["ops"]
    return sorted((o["kind"], o["dtype"], str(o["shapes"]), o["group_size"], o["multiplicity"]) for o in ops)


def test_context_1_compiles_to_the_collectives_of_the_three_axis_mesh():
    """A `context` axis of size 1 changes no program: the train step on (data 2, context 1,
    tensor 2) with SP and the distributed optimizer has the collectives it has on a mesh
    without the axis."""
    cfg = tiny_config("llama", 2, 1, 2, True, extra=["parallel.distributed_optimizer=true"])
    four = build(cfg, 2, 1, 2)
    assert "context" in four.mesh.axis_names
    devices = np.array(jax.devices()[:4], dtype=object).reshape(2, 1, 2)
    three = Trainer(cfg, Mesh(devices, (DATA, PIPE, TENSOR), axis_types=(AxisType.Auto,) * 3), VOCAB)
    assert _collectives(four) == _collectives(three) != []


def test_a_checkpoint_moves_between_context_sizes(tmp_path):
    """Saved at c = 2 with the distributed optimizer (state split over data x context); restored
    at c = 1 and c = 4: the same parameters and optimizer state, bitwise, and the same next loss."""
    from mtjax.checkpoint import Checkpointer
    from test_checkpoint import config, run, vocab_rows
    base = ["model.dropout=0.0", "parallel.distributed_optimizer=true", "train.micro_batch=1"]
    cfg = config(tmp_path, 2, 1, 1, 1, base + ["parallel.context=2"])
    trainer = build(cfg, 1, 1, 1, 2)
    ck = Checkpointer(cfg)
    run(cfg, trainer, checkpointer=ck)
    ck.close()
    ck = Checkpointer(cfg)
    saved = ck.restore(2, trainer)
    ck.close()
    expected = vocab_rows(jax.device_get((saved.params, saved.opt_state)), VOCAB)
    batch = random_batch(7)
    ref = float(trainer.eval_step(saved.params, trainer.put_batch(batch)))
    for context, extra in ((1, ["parallel.distributed_optimizer=false"]), (4, [])):
        other_cfg = config(tmp_path, 2, 1, 1, 1, [*base, f"parallel.context={context}", *extra])
        other = build(other_cfg, 1, 1, 1, context)
        ck = Checkpointer(other_cfg)
        state = ck.restore(2, other)
        ck.close()
        got = vocab_rows(jax.device_get((state.params, state.opt_state)), VOCAB)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)
        loss = float(other.eval_step(state.params, other.put_batch(batch)))
        assert abs(loss - ref) <= 1e-5 * abs(ref), (context, loss, ref)


BAD = [  # (overrides, devices, key, words)
    (["parallel.context=2", "model.seq_len=18"], 2, "model.seq_len", "2*context = 2*2"),
    (["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "model.seq_len=12"], 4,
     "model.seq_len", "2*context*tensor = 2*2*2"),
    (["parallel.context=2", "parallel.context_attention=star"], 2, "parallel.context_attention", "all_gather, ring"),
    (["parallel.context_attention=ring"], 1, "parallel.context_attention", "no effect"),
    (["parallel.context=3"], 4, "parallel.data", "--cpu-devices 6"),
    (["parallel.context=0"], 1, "parallel.context", ">= 1"),
    (["parallel.context=2", "parallel.tensor=4", "parallel.tensor_grid=2d", "train.micro_batch=2"], 8,
     "parallel.context", "tensor_grid=2d"),
]


@pytest.mark.parametrize("overrides,devices,key,words", BAD, ids=[b[2] + "-" + b[3][:12] for b in BAD])
def test_bad_context_settings_are_one_line(overrides, devices, key, words):
    cfg = load_config(None, ["train.global_batch=8", "train.micro_batch=1", "model.seq_len=16", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, devices)
    assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_inspect_layout_names_the_context_axis():
    """`inspect --json`'s layout section holds every mesh axis: its sizes multiply to the devices."""
    from mtjax.inspect_summary import plan_layout
    trainer = build(context_config("gpt", 1, 1, 2, 2, True, "ring"), 1, 1, 2, 2)
    layout = plan_layout(trainer.plan)
    assert layout["context"] == 2
    assert layout["data"] * layout["pipe"] * layout["context"] * layout["tensor"] == trainer.mesh.size
