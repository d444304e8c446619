"""The model on a mesh, apart from training: what its parameters are and where they live, the
weights it computes with, and its forward pass.

`resolve_layout(cfg, mesh, vocab)` answers, for a config and a (data, pipe, tensor) mesh:
  - per parameter its global shape, mesh PartitionSpec (from its logical axes, `partitioning.py`)
    and whether its gradient is a partial sum over `tensor` (`ParamLayout`);
  - the canonical layer order and the order this layout stores the layers in (`layer_rows`):
    with v chunks per stage the `layers` axis is kept in run order (`pipeline/layer_order.py`);
  - the compute-dtype parameters (`compute_params`: master weights cast, then gathered);
  - the logits (`logits_fn`).
The Trainer builds its step plan on top of this (`training/plan.py`); `mtjax.load`, the
converters and `train.init_from` use it alone, so opening a checkpoint builds no optimizer, no
gradient function and no pipeline table.

Shape legend: B rows, s tokens, h hidden, V vocabulary (padded V_p), d data, p pipe, t tensor,
v chunks per stage, l layers, L = l/(p v) layers per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mtjax.config.schema import Config, ModelConfig
from mtjax.mesh import CONTEXT, DATA, PIPE, TENSOR, axis_sizes
from mtjax.model.core_attention import resolve_attention
from mtjax.model.documents import find_documents
from mtjax.model.grid_model import GridTransformer, gather_grid_logits
from mtjax.model.layer_pattern import chunk_layers, layer_pattern
from mtjax.model.moe import stays_fp32
from mtjax.model.transformer import Recompute, Transformer
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.context_ops import gather_rows, split_row
from mtjax.parallel.grid import Grid, grid_mesh, grid_specs, grid_sums, make_grid
from mtjax.parallel.reductions import tensor_reductions
from mtjax.parallel.vocab import drawn_vocab_size, gather_logits, padded_vocab_size
from mtjax.partitioning import mesh_specs, rules_for, shardings
from mtjax.pipeline.layer_order import canonical_order, layer_order, permute_layers
from mtjax.pipeline.table import stage_and_chunk

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


class ParamLayout(NamedTuple):
    """The parameters as the model computes with them (trees shaped like the parameters)."""
    specs: Any         # mesh PartitionSpecs
    shapes: Any        # global ShapeDtypeStructs
    tensor_sums: Any   # bool per leaf: its gradient is a partial sum over `tensor` (psum-ed),
                       # derived from how each parameter is declared (`parallel/reductions.py`)


@dataclass(frozen=True, eq=False)
class ModelLayout:
    """One model on one mesh; every field resolved."""

    model: ModelConfig
    mesh: Any                    # the (data, pipe, context, tensor) mesh; a tensor grid's sub-axes named
    data: int                    # d
    pipe: int                    # p
    tensor: int                  # t
    vocab: int                   # V, the tokenizer's
    padded_vocab: int            # V_p: V rounded up to a multiple of vocab_multiple * t (q on a grid)
    sequence_parallel: bool      # active: asked for and t > 1
    precision: str               # fp32 | bf16 | fp16: the compute dtype
    attention: str               # the core attention kernel (`resolve_attention`)
    params: ParamLayout          # specs, shapes and tensor reductions of every parameter
    grid: Grid | None = None     # 2d / 2.5d tensor grid; None: Megatron's 1D
    virtual_stages: int = 1      # v, chunks per stage
    chunk_order: str = "loop"    # how virtual stages sit on stages (`pipeline/table.virtual_stage`)
    context: int = 1             # c: every row split c ways (`parallel/context_ops.py`)
    context_attention: str = "all_gather"   # how attention crosses `context` (c > 1)
    tensor_overlap: bool = False # collective matmuls (`parallel/collective_matmul.py`); only with sp
    expert: int = 1              # e, expert-parallel ranks (`model/moe.py`)
    experts_split: bool = False  # e = d c: each replica stores only its E/e experts (specs over data x context)
    half_batches: bool = False   # each layer's two half-batches interleaved (`parallel/half_batches.py`)
    half_batch_group: int = 1    # consecutive layers interleaved as one unit (`block.halved`)
    half_batch_axis: str = "batch"   # the halves' axis: batch or sequence (`block.halved`)

    @property
    def compute_dtype(self):
        return DTYPES[self.precision]

    @property
    def layers_per_chunk(self) -> int:
        """l without a pipeline; with one, a chunk's (l - P)/(p v) (`layer_pattern.chunk_layers`)."""
        return chunk_layers(self.model, self.pipe, self.virtual_stages)

    @property
    def param_shardings(self):
        """Where the parameters live while the model computes with them."""
        return shardings(self.mesh, self.params.specs)

    def global_model(self) -> Transformer:
        """The model with global shapes (t = 1) at this layout's padded vocabulary: it declares the
        parameters the layout computes with."""
        return Transformer(self.model, self.padded_vocab)

    def drawn_model(self) -> Transformer:
        """The model the parameters are drawn with: global shapes, and every vocabulary-sized
        parameter at V rounded to `vocab_multiple` alone (`vocab.drawn_vocab_size`), a size no
        layout changes, so one seed gives one model on every layout; the draw is zero-padded to
        `padded_vocab` (`training.state.draw_params`)."""
        return Transformer(self.model, drawn_vocab_size(self.vocab, self.model.vocab_multiple))

    def local_model(self, layers: int | None = None, deterministic: bool = True,
                    recompute: Recompute = Recompute()) -> Transformer:
        """The model as one device inside shard_map sees it: local shapes over `tensor`, `layers`
        of them (default all l)."""
        # XLA:CPU cannot run a collective-permute inside one pipeline stage's branch (`pass_to_next_rank`)
        by_all_to_all = self.pipe > 1 and self.mesh.devices.flat[0].platform == "cpu"
        ctx = ParallelContext(tensor=self.tensor, sp=self.sequence_parallel, grid=self.grid, context=self.context,
                              context_attention=self.context_attention, ring_by_all_to_all=by_all_to_all,
                              tensor_overlap=self.tensor_overlap, half_batches=self.half_batches,
                              half_batch_group=self.half_batch_group, half_batch_axis=self.half_batch_axis,
                              expert=self.expert,
                              expert_axes=(DATA, CONTEXT) if self.context > 1 else (DATA,),
                              replicas=self.data * self.context, experts_split=self.experts_split)
        model = Transformer if self.grid is None else GridTransformer
        return model(self.model, self.padded_vocab, ctx, self.compute_dtype, deterministic,
                     layers or self.model.num_layers, recompute, self.attention)

    # ---------------------------------------------------------------- layer order

    def layer_rows(self):
        """(run order, canonical order) row permutations of the `layers` axis, or None when the
        two are the same (v = 1)."""
        if self.virtual_stages == 1:
            return None
        rows = layer_pattern(self.model).rows(self.model.num_layers)   # units of f layers (`layer_pattern.py`)
        args = (rows, self.pipe, self.virtual_stages, self.chunk_order)
        return layer_order(*args), canonical_order(*args)

    def run_order(self, tree):
        """A parameter-shaped tree (or any tree with `layers` subtrees) from canonical order into
        the order this layout stores the layers in."""
        rows = self.layer_rows()
        return tree if rows is None else permute_layers(tree, rows[0])

    def canonical(self, tree):
        """The inverse of `run_order`: what checkpoints, the reference and users see."""
        rows = self.layer_rows()
        return tree if rows is None else permute_layers(tree, rows[1])


def param_layout(cfg: Config, padded_vocab: int, tensor: int, sequence_parallel: bool,
                 grid: Grid | None = None, expert=None) -> ParamLayout:
    """The parameters as declared (boxes with logical axes and Megatron's `sequence_parallel`
    flag), turned into this layout's specs, shapes and tensor reductions. On a tensor grid the
    specs and reductions are the grid's (`grid.grid_specs`, `grid.grid_sums`: axis names)."""
    rules = rules_for(cfg.model.kv_heads, tensor, expert)
    declared = abstract_params(Transformer(cfg.model, padded_vocab), cfg.model.seq_len)
    shapes = nn.unbox(declared)
    if grid is not None:
        return ParamLayout(grid_specs(shapes), shapes, grid_sums(shapes, grid))
    return ParamLayout(mesh_specs(declared, rules), shapes,
                       tensor_reductions(declared, rules, tensor, sequence_parallel))


def abstract_params(model, seq_len: int):
    """Boxed (logically annotated) parameter shapes, without allocating anything."""
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def resolve_layout(cfg: Config, mesh, vocab: int, virtual_stages: int = 1, chunk_order: str = "loop") -> ModelLayout:
    """`cfg`'s model (already validated) on `mesh`, for a tokenizer of `vocab` ids, with
    `virtual_stages` chunks per pipeline stage laid out as `chunk_order`."""
    sizes = axis_sizes(mesh)
    d, p, t = sizes[DATA], sizes[PIPE], sizes[TENSOR]
    mc, precision = cfg.model, cfg.train.precision
    grid = make_grid(cfg.parallel.tensor_grid, t, cfg.parallel.tensor_depth)
    padded = padded_vocab_size(vocab, mc.vocab_multiple, t if grid is None else grid.q)
    sp = cfg.parallel.sequence_parallel and t > 1
    attention = resolve_attention(mc.attention, mesh.devices.flat[0], DTYPES[precision], mc.head_dim,
                                  mc.attention_dropout)
    e = expert_ranks(cfg.parallel.expert, d * sizes[CONTEXT])
    held = ((DATA, CONTEXT) if sizes[CONTEXT] > 1 else DATA) if 1 < e == d * sizes[CONTEXT] else None
    return ModelLayout(mc, grid_mesh(mesh, grid), d, p, t, vocab, padded, sp, precision, attention,
                       param_layout(cfg, padded, t, sp, grid, held), grid, virtual_stages if p > 1 else 1, chunk_order,
                       sizes[CONTEXT], cfg.parallel.context_attention, cfg.parallel.tensor_overlap and sp,
                       e, held is not None, cfg.parallel.half_batch_overlap and t > 1, cfg.parallel.half_batch_group,
                       cfg.parallel.half_batch_axis)


def expert_ranks(expert: int, replicas: int) -> int:
    """e on this mesh: `parallel.expert`, validated against the training mesh; a layout on another
    mesh (a converter's one device, generation) whose replicas e does not divide holds every
    expert on each rank (e = 1): the weights' shapes never depend on e."""
    return expert if replicas % expert == 0 else 1


def compute_params(layout: ModelLayout, master, master_shardings=None, compute_shardings=None):
    """The parameters the model computes with: the master weights cast to the compute dtype,
    then moved to the compute layout. Every layout computes with the same rounded weights, norm
    scales and biases included, as Megatron's 16-bit model does; the MoE router's aux-loss-free
    bias stays fp32 (`moe.stays_fp32`), as Megatron's `expert_bias` does.

    Two layouts, in this order, when the master lives elsewhere (`master_shardings`: split over
    `data` or `pipe` by the distributed optimizer): the cast happens where the master shard
    lives, then the cast values move, so an all-gather moves 16-bit values. (Left free, sharding
    propagation gives the cast the gathered layout, and the partitioner gathers fp32 weights.)
    `compute_shardings` (FSDP: the layer stack stays split) replaces the layout's."""
    def cast_leaf(path, w):
        keys = tuple(getattr(k, "key", k) for k in path)
        return w if stays_fp32(keys) else w.astype(layout.compute_dtype)
    cast = jax.tree_util.tree_map_with_path(cast_leaf, master)
    if master_shardings is not None:
        cast = lax.with_sharding_constraint(cast, master_shardings)                 # cast in place
    target = layout.param_shardings if compute_shardings is None else compute_shardings
    return lax.with_sharding_constraint(cast, target)                              # then gather


def logits_fn(layout: ModelLayout, eod: int | None = None):
    """(params, tokens [B, s]) -> full fp32 logits [B, s, V] (gathered over `tensor`, and over
    `context`: each context rank runs its s/c tokens), rows split over `data` (B a multiple of
    d), s <= model.seq_len (a multiple of 2c with context parallelism). With pipe > 1 the stream visits the
    p v chunks in canonical order: the stage holding virtual stage j runs its L layers and the
    result is summed over `pipe` (the other stages add zeros), so every stage holds the stream
    the next chunk reads. Not a schedule: for evaluation, tests and users, not throughput.
    With `eod`, rows are packed documents ending at that id (`model/documents.py`)."""
    L, p, v = layout.layers_per_chunk, layout.pipe, layout.virtual_stages
    model, c = layout.local_model(L if p > 1 else None), layout.context
    rows = layer_pattern(layout.model, L).rows(L)  # a chunk's rows of the `layers` stack (units of f layers)

    def body(params, tokens):
        docs = None if eod is None else find_documents(tokens, eod)             # whole rows [B/d, s]
        tokens = split_row(tokens, c)                                            # [B/d, s/c]: this rank's chunks
        if p == 1:
            logits = model.apply({"params": params}, tokens, docs)               # [B/d, s/c, V/t]
            if layout.grid is not None:
                return gather_grid_logits(logits, layout.vocab, layout.model.tied)
            return gather_rows(gather_logits(logits, layout.vocab, layout.tensor), c)   # [B/d, s, V]
        if layout.grid is not None:     # raised when called: a grid trainer with pipe > 1 still trains
            raise ValueError("logits through pipeline stages on a 2d/2.5d tensor grid are not implemented "
                             "(the training and evaluation steps are)")
        x = model.apply({"params": params}, tokens, docs=docs, method="embed_and_prefix")
        stage = lax.axis_index(PIPE)
        for j in range(p * v):
            holder, k = stage_and_chunk(layout.chunk_order, p, j)
            chunk = jax.tree.map(lambda w, k=k: lax.slice_in_dim(w, k * rows, (k + 1) * rows), params["layers"])
            y = model.apply({"params": {**params, "layers": chunk}}, x, docs=docs, method="run_layers")
            x = lax.psum(jnp.where(stage == holder, y, jnp.zeros_like(y)), PIPE)
        logits = model.apply({"params": params}, x, method="head")
        return gather_rows(gather_logits(logits, layout.vocab, layout.tensor), c)

    return jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(layout.params.specs, P(DATA, None)),
                                 out_specs=P(DATA, None, None), check_vma=False))
