"""The train and eval steps: one `jax.jit`, inside it one `shard_map` over (data, pipe, tensor).

Shape legend: B global batch, m micro-batches, b micro-batch, s sequence,
d data size, t tensor size; batches hold s + 1 tokens (inputs and labels).

Inside `shard_map` each device sees its parameter shards and its data
rank's B/d sequences, runs m micro-batches, and accumulates gradients
locally. Then, once per global batch:
  * with pipe > 1, the sum over `pipe` of the leaves every stage holds (embedding, positions,
    final norm, head), reduce-scattered into the optimizer state's pipe split (`zero.py`);
  * all-reduce over `data` (the data-parallel gradient reduction; a reduce-scatter with the
    distributed optimizer);
  * all-reduce over `tensor` of the gradients that are partial sums there:
    parameters replicated over `tensor` but used on different data on each
    rank, as their declarations say (`parallel/reductions.py`: norms, biases
    and positions under sequence parallelism; kv heads replicated because k < t).
With Megatron's state layout the local sums are also returned as the
`main_grad` buffer; they must then be complete over `tensor`, so the
`tensor` sums come first.
The optimizer then updates the global (sharded) arrays outside shard_map.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.config.schema import Config
from mtjax.config.validate import batch_split
from mtjax.mesh import DATA, PIPE, TENSOR, axis_sizes
from mtjax.model.transformer import Transformer
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.vocab import gather_logits
from mtjax.training.loss import scaled_loss_sum
from mtjax.training.zero import StateSplit
from mtjax.partitioning import uses_axis
from mtjax.pipeline.executor import StageFns, pipeline_forward, pipeline_grads, stage_activation_shape
from mtjax.pipeline.schedules import forward_only

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


@dataclass(frozen=True)
class StepLayout:
    """Static sizes of one step: mesh sizes, micro-batching, vocabulary."""

    data: int
    pipe: int
    tensor: int
    micro_batches: int     # m
    micro_batch: int       # b
    seq_len: int           # s
    vocab: int             # unpadded V (the loss masks the padding)

    @property
    def tokens_per_step(self) -> int:
        return self.data * self.micro_batches * self.micro_batch * self.seq_len


def step_layout(cfg: Config, mesh, vocab: int) -> StepLayout:
    sizes = axis_sizes(mesh)
    b, m = batch_split(cfg, sizes[DATA])
    return StepLayout(sizes[DATA], sizes[PIPE], sizes[TENSOR], m, b,
                      cfg.model.seq_len, vocab)


def local_model(cfg: Config, layout: StepLayout, padded_vocab: int, deterministic: bool,
                stage: bool = False) -> Transformer:
    """The model as one device inside shard_map sees it: local shapes over `tensor`, and with
    `stage` only one model chunk's l/(p v) layers, of which block recomputation recomputes the
    first `train.recompute_layers`."""
    ctx = ParallelContext(tensor=layout.tensor, sequence_parallel=cfg.parallel.sequence_parallel)
    chunks = layout.pipe * cfg.parallel.virtual_stages          # p v model chunks in all
    layers = cfg.model.num_layers // chunks if stage else cfg.model.num_layers
    tr = cfg.train
    # block mode's N counts within each chunk: a stage (or virtual stage) recomputes its first N
    return Transformer(cfg.model, padded_vocab, ctx, DTYPES[tr.precision], tr.recompute, deterministic, layers,
                       recompute_layers=tr.recompute_layers, offload=tr.offload_activations)


def stage_fns(model, layout: StepLayout, head=None, scale=1.0) -> StageFns:
    """The model as the pipeline executor runs it (see `StageFns`). Training batches hold s + 1
    tokens; the head defaults to the micro-batch's loss sum times `scale`."""
    def embed(shared, tokens, key):
        rngs = {} if key is None else {"dropout": key}
        return model.apply({"params": shared}, tokens[:, :-1], rngs=rngs, method="embed_tokens_to_stream")

    def layers(shared, runs, x, key):
        rngs = {} if key is None else {"dropout": key}
        return model.apply({"params": shared}, x, runs, rngs=rngs, method="run_layers")

    def loss(shared, y, tokens):
        logits = model.apply({"params": shared}, y, method="head")                 # [b, s, V/t]
        return scaled_loss_sum(logits, tokens[:, 1:], layout, scale)
    return StageFns(embed, layers, head or loss)


def _as_computed(params, dtype):
    """Matmul weights in the compute dtype, everything else as given. The layers cast their
    kernels to the compute dtype anyway (`parallel/layers.py`); casting first makes the cast
    weights the pullback's residuals *be* the parameters, which the executor then does not
    stash per micro-batch. The gradients are the same: a cast's backward casts back."""
    def cast(path, w):
        return w.astype(dtype) if getattr(path[-1], "key", None) == "kernel" else w
    return jax.tree_util.tree_map_with_path(cast, params)


def _activation_shape(model, layout: StepLayout):
    return stage_activation_shape(layout.micro_batch, layout.seq_len, model.cfg.hidden_size, layout.tensor,
                                  model.ctx.sp)


def _micro_batch_loss(model, params, tokens, rng, layout: StepLayout, scale=1.0):
    """Sum of this micro-batch's token losses / (B s), so the sums over micro-batches and
    data ranks give the global mean. tokens [b, s + 1] -> scalar."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]                    # [b, s]
    logits = model.apply({"params": params}, inputs, rngs={"dropout": rng})   # [b, s, V/t]
    return scaled_loss_sum(logits, labels, layout, scale)


def _accumulated_grads(model, params, mbs, keys, layout: StepLayout, scale):
    """No pipeline: value_and_grad per micro-batch, summed over a scan. -> (grads, loss sum), both
    multiplied by the loss scale."""
    grad_fn = jax.value_and_grad(lambda p, x, k: _micro_batch_loss(model, p, x, k, layout, scale))

    def accumulate(acc, xs):
        tokens, key = xs
        loss, grads = grad_fn(params, tokens, key)
        return jax.tree.map(jnp.add, acc, grads), loss

    grads, losses = lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), (mbs, keys))
    return grads, jnp.sum(losses)


def _gloo_collectives() -> bool:
    """True where XLA runs the collectives through gloo: CPU devices of several processes."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def _psum_scatter(x, axis: str, dim: int):
    """`lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)`: this rank's 1/n block of
    the sum along `dim`. Through gloo (CPU, several processes) XLA's reduce-scatter intermittently
    returns wrong values at the end of rank 0's block (jax-ml/jax#40830; seen here with jaxlib
    0.10.2); there the blocks come from an all-to-all (block i of every rank to rank i) and a local
    sum in rank order, which moves the same bytes."""
    if not _gloo_collectives():
        return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    n = lax.axis_size(axis)
    blocks = lax.all_to_all(x, axis, dim, dim, tiled=True)     # [..., n x size/n (rank-major), ...]
    return blocks.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:]).sum(dim)


def _reduce_over_data(grads, scatter_dims):
    """All-reduce over `data`, or with the distributed optimizer reduce-scatter each leaf along
    its scatter dimension (this rank keeps the 1/d of the gradient it updates)."""
    if scatter_dims is None:
        return lax.psum(grads, DATA)
    return jax.tree.map(lambda g, k: lax.psum(g, DATA) if k is None
                        else _psum_scatter(g, DATA, k),
                        grads, scatter_dims, is_leaf=lambda x: x is None)


def _reduce_over_pipe(grads, replicated, scatter_dims):
    """Sum over `pipe` the gradients of the pipe-replicated leaves (embedding, positions, final
    norm, head: only the first/last stage holds a share): reduce-scattered along the dimension the
    optimizer state splits over `pipe`, all-reduced where it does not (`scatter_dims` None or a
    leaf's None). Before the `data` reduction, whose blocks are minor to the pipe blocks."""
    dims = jax.tree.map(lambda _: None, replicated) if scatter_dims is None else scatter_dims

    def one(g, r, k):
        if not r:
            return g
        return lax.psum(g, PIPE) if k is None else _psum_scatter(g, PIPE, k)
    return jax.tree.map(one, grads, replicated, dims)


def main_grad_specs(specs):
    """Specs of the `main_grad` buffer [d, *param shape]: one row per data rank."""
    return jax.tree.map(lambda s: P(DATA, *s), specs, is_leaf=lambda x: isinstance(x, P))


def make_grad_fn(model, mesh, specs, layout: StepLayout, reductions, schedule=None, act_dtype=jnp.float32,
                 split: StateSplit | None = None, keep_local=False):
    """(params, batch [B, s+1], rng, loss scale S) -> (S x grads, mean loss), gradients reduced.

    With pipe > 1, `model` holds one stage's layers and `schedule` drives the executor. The
    gradients come out in the optimizer state's layout `split` (`zero.py`): reduce-scattered over
    `pipe` where it splits a pipe-replicated leaf, and over `data` with the distributed optimizer
    (None: the parameter layout, all-reduced). With `keep_local` a third output is every data
    rank's own S x gradient sum before the data reduction, [d, *param shape] (`main_grad_specs`
    of `split.local_specs`: split over `pipe` as the state is). `reductions` (a tree of bools,
    `parallel/reductions.py: tensor_reductions`) marks the gradients summed over `tensor`.
    """
    split = split or StateSplit(specs=specs, pipe_dims=None, data_dims=None, local_specs=specs)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    pipe_replicated = jax.tree.map(lambda s: not uses_axis(s, PIPE), specs, is_leaf=is_spec)

    def tensor_sums(grads):
        return jax.tree.map(lambda g, r: lax.psum(g, TENSOR) if r else g, grads, reductions)

    def body(params, batch, rng_data, scale):
        # fp32 leaves to differentiate, so gradients accumulate in fp32 whatever the compute dtype
        params = jax.tree.map(lambda w: w.astype(jnp.float32), params)
        rng = jax.random.fold_in(jax.random.wrap_key_data(rng_data), lax.axis_index(DATA))
        mbs = batch.reshape(layout.micro_batches, layout.micro_batch, -1)     # [m, b, s+1]
        keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(layout.micro_batches))
        if layout.pipe == 1:
            grads, loss = _accumulated_grads(model, params, mbs, keys, layout, scale)
        else:
            fns = stage_fns(model, layout, scale=scale)
            grads, loss = pipeline_grads(fns, _as_computed(params, act_dtype), mbs, keys, schedule,
                                         _activation_shape(model, layout), act_dtype, model.layer_runs)
            grads = _reduce_over_pipe(grads, pipe_replicated, split.pipe_dims)
            loss = lax.psum(loss, PIPE)
        loss = lax.psum(loss, DATA) / scale
        if keep_local:
            grads = tensor_sums(grads)                       # main_grad is complete over tensor
            local = jax.tree.map(lambda g: g[None], grads)   # [1, *local shape]: this data rank's row
            return _reduce_over_data(grads, split.data_dims), loss, local
        grads = _reduce_over_data(grads, split.data_dims)   # once per global batch
        return tensor_sums(grads), loss

    out_specs = (split.specs, P()) + ((main_grad_specs(split.local_specs),) if keep_local else ())
    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA, None), P(), P()),
                       out_specs=out_specs, check_vma=False)
    return fn


def _eval_schedule(layout: StepLayout, schedule, micro_batches: int):
    """The forward-only schedule that evaluation runs, with the training schedule's chunking."""
    return forward_only(layout.pipe, micro_batches, 1 if schedule is None else schedule.chunks)


def make_loss_fn(model, mesh, specs, layout: StepLayout, schedule=None):
    """(params, batch [B, s+1]) -> mean loss, no gradients (validation). With pipe > 1 the
    forward runs through the stages (`model` holds one chunk) on a forward-only schedule."""
    def body(params, batch):
        mbs = batch.reshape(layout.micro_batches, layout.micro_batch, -1)
        if layout.pipe == 1:
            key = jax.random.key(0)   # deterministic model: dropout is off, the key is unused

            def one(total, tokens):
                return total + _micro_batch_loss(model, params, tokens, key, layout), None
            total, _ = lax.scan(one, jnp.float32(0), mbs)
        else:
            losses = pipeline_forward(stage_fns(model, layout), params, mbs, None,
                                      _eval_schedule(layout, schedule, layout.micro_batches),
                                      _activation_shape(model, layout), model.dtype, model.layer_runs,
                                      jax.ShapeDtypeStruct((), jnp.float32))
            total = lax.psum(jnp.sum(losses), PIPE)      # only the last stage's are non-zero
        return lax.psum(total, DATA)

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA, None)), out_specs=P(), check_vma=False)


def make_logits_fn(model, mesh, specs, layout: StepLayout, schedule=None):
    """(params, tokens [B, s]) -> full logits [B, s, V] (gathered over `tensor`; for evaluation and
    tests). With pipe > 1 each data rank's rows run through the stages one row per micro-batch,
    padded to a multiple of p rows."""
    def body(params, tokens):
        if layout.pipe == 1:
            logits = model.apply({"params": params}, tokens)               # [B/d, s, V/t]
            return gather_logits(logits, layout.vocab, layout.tensor)      # [B/d, s, V]
        rows, p = tokens.shape[0], layout.pipe
        m = max(p, -(-rows // p) * p)
        mbs = jnp.zeros((m, 1, tokens.shape[1] + 1), tokens.dtype).at[:rows, 0, :-1].set(tokens)
        fns = stage_fns(model, replace(layout, micro_batch=1),
                        head=lambda q, y, _: model.apply({"params": q}, y, method="head")[0])
        cols = model.vocab // layout.tensor
        logits = pipeline_forward(fns, params, mbs, None, _eval_schedule(layout, schedule, m),
                                  _activation_shape(model, replace(layout, micro_batch=1)), model.dtype,
                                  model.layer_runs, jax.ShapeDtypeStruct((tokens.shape[1], cols), jnp.float32))
        logits = lax.psum(logits[:rows], PIPE)                              # [B/d, s, V/t] from the last stage
        return gather_logits(logits, layout.vocab, layout.tensor)

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA, None)), out_specs=P(DATA, None, None),
                         check_vma=False)


def batch_sharding(mesh) -> NamedSharding:
    """Global batches [B, s+1] are split over `data` along B."""
    return NamedSharding(mesh, P(DATA, None))
