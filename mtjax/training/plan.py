"""The step plan: what one training step is, resolved once from (config, mesh, vocabulary).

Validation (`config/validate/`) says whether a config makes sense; `resolve_plan` turns a
valid config, the mesh and the tokenizer's V into the facts a step is built from, on top of
the model's layout (`mtjax/layout.py`). The model (through `step.local_model`), the step and its
pipeline executor, FLOPs accounting and
checkpoints read the plan; none of them re-derives these facts from the config.

Shape legend: B global batch, d data, c context, p pipe (stages), t tensor, v chunks per stage, m
micro-batches, b micro-batch, s sequence, l layers, P a dense prefix's layers, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec as P

from mtjax.config.schema import Config
from mtjax.config.validate import batch_split
from mtjax.layout import DTYPES, ModelLayout, ParamLayout, resolve_layout
from mtjax.mesh import CONTEXT, DATA, PIPE, TENSOR, axis_sizes
from mtjax.model.moe import step_fp32
from mtjax.model.transformer import Recompute, Transformer
from mtjax.parallel.fsdp import Fsdp, fsdp_dims
from mtjax.parallel.grid import Grid
from mtjax.pipeline.schedules import Schedule, chunks_per_stage, make_schedule
from mtjax.training.zero import StateSplit, state_split


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Static facts of one step; every field is resolved, none is a raw option."""

    data: int                    # d
    pipe: int                    # p
    tensor: int                  # t
    micro_batches: int           # m
    micro_batch: int             # b; B = d m b
    seq_len: int                 # s
    num_layers: int              # l, of the whole model
    vocab: int                   # V, the tokenizer's (the loss masks the padding)
    padded_vocab: int            # V rounded up to a multiple of vocab_multiple * t
    sequence_parallel: bool      # active: asked for and t > 1
    precision: str               # fp32 | bf16 | fp16
    recompute: Recompute         # mode (none | selective | full | block), block's N per chunk, offload
    attention: str               # the core attention kernel: xla | dot_product | cudnn (`resolve_attention`)
    deterministic: bool          # no dropout anywhere
    virtual_stages: int          # v, the chunks a stage holds (2 for zbv)
    schedule: Schedule | None    # the training schedule's table; None without pipelining
    distributed_optimizer: bool  # master weights and moments split over the replicas (also on with fsdp)
    params: ParamLayout          # specs, shapes and tensor reductions of every parameter
    split: StateSplit            # the optimizer state's split over `pipe` and the replicas, per leaf
    grid: Grid | None = None     # 2d / 2.5d tensor grid (`parallel/grid.py`); None: Megatron's 1D
    tied: bool = False           # the output layer is the embedding (the grid's logits layout follows)
    layout: ModelLayout | None = None   # the model's side of the plan (`mtjax/layout.py`)
    context: int = 1             # c: each row split c ways over `context` (`parallel/context_ops.py`)
    eod: int = -1                # the end-of-document id (the tokenizer's), -1 when none was given
    document_masking: bool = False   # packed rows (`model/documents.py`, `training/packing.py`)
    eod_mask_loss: bool = False  # no loss where the input is EOD
    fsdp: Fsdp | None = None     # the layer stack held split over the replicas (`parallel/fsdp.py`)

    @property
    def compute_specs(self):
        """Where the parameters live while the step computes with them: `params.specs`, except
        that under FSDP the layer leaves it shards keep the state's split over the replicas."""
        if self.fsdp is None:
            return self.params.specs
        specs = dict(self.params.specs)
        whole = jax.tree.map(lambda k: k is None, self.fsdp.dim_tree(), is_leaf=lambda x: x is None)
        specs["layers"] = jax.tree.map(lambda w, s, p: p if w else s, whole, self.split.specs["layers"],
                                       self.params.specs["layers"], is_leaf=lambda x: isinstance(x, (bool, P)))
        return specs

    @property
    def masks_loss(self) -> bool:
        """Some labels carry no loss: the loss divides by the count of those that do."""
        return self.document_masking or self.eod_mask_loss

    @property
    def compute_dtype(self):
        return DTYPES[self.precision]

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes over which the parameters are replicated and each rank's gradient is a
        partial sum: `data`, and `context` when c > 1 (each context rank differentiates its s/c
        tokens). The data reduction, the loss sum and the distributed optimizer's split run over
        them (d c ranks); `context` is named only when c > 1, so c = 1 is the 3-axis program."""
        return (DATA, CONTEXT) if self.context > 1 else (DATA,)

    @property
    def replicas(self) -> int:
        """d c: the ranks of `replica_axes`."""
        return self.data * self.context

    @property
    def local_seq_len(self) -> int:
        """s / c: the tokens of a row one device holds."""
        return self.seq_len // self.context

    @property
    def global_batch(self) -> int:
        return self.data * self.micro_batches * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def layers_per_chunk(self) -> int:
        """(l - P) / (p v): the layers one model chunk (one stage without interleaving) runs; l
        without a pipeline (`layer_pattern.chunk_layers`: P, a dense prefix, runs with the embedding)."""
        return self.layout.layers_per_chunk

    @property
    def recomputed_layers(self) -> int:
        """Layers that block recomputation re-runs over all stages: N per chunk, p v chunks."""
        r = self.recompute
        return r.layers * self.pipe * self.virtual_stages if r.mode == "block" else 0

    @property
    def keeps_compute_copy(self) -> bool:
        """The step computes with a cast (and gathered) copy of the master weights, not with the
        master itself: 16-bit compute, or master weights split over the replicas."""
        return self.precision != "fp32" or self.distributed_optimizer


def _fsdp(cfg: Config, split: StateSplit, context: int, p: int) -> Fsdp:
    """FSDP's layout from the distributed optimizer's split of the layer stack; the leaves whose
    value in the step is not the compute copy's gathered in fp32 (`moe.step_fp32`)."""
    par, dims = cfg.parallel, fsdp_dims(split.data_dims["layers"])
    return Fsdp((DATA, CONTEXT) if context > 1 else (DATA,), dims, par.fsdp_keep_gathered, DTYPES[cfg.train.precision],
                par.fsdp_pipeline_gather == "step" and p > 1, tuple(k for k, _ in dims if step_fp32(k)))


def global_model(cfg: Config, padded_vocab: int) -> Transformer:
    """The model with global shapes (t = 1): it initialises the parameters and declares them."""
    return Transformer(cfg.model, padded_vocab)


def resolve_plan(cfg: Config, mesh, vocab: int, eod: int | None = None) -> StepPlan:
    """The plan of `cfg` (already validated) on `mesh`, for a tokenizer of `vocab` ids whose
    end-of-document id is `eod` (needed with `data.document_masking` or `data.eod_mask_loss`). The
    model's side of it (parameters, vocabulary padding, kernel, layer order) is the layout's
    (`mtjax/layout.py`); the plan adds the batch split, the schedule and the optimizer state."""
    sizes = axis_sizes(mesh)
    d, p, t = sizes[DATA], sizes[PIPE], sizes[TENSOR]
    b, m = batch_split(cfg, d)
    par, tr, mc = cfg.parallel, cfg.train, cfg.model
    schedule = make_schedule(par.schedule, p, m, par.virtual_stages, par.max_in_flight) if p > 1 else None
    layout = resolve_layout(cfg, mesh, vocab, chunks_per_stage(par.schedule, par.virtual_stages),
                            schedule.layout if schedule is not None else "loop")
    params = layout.params
    dc = cfg.data
    if (dc.document_masking or dc.eod_mask_loss) and eod is None:
        raise ValueError("data.document_masking and data.eod_mask_loss need the tokenizer's end-of-document id")
    distributed = par.distributed_optimizer or par.fsdp          # fsdp implies ZeRO-1's split
    split = state_split(params.specs, params.shapes, layout.mesh, distributed)
    context = layout.context
    fsdp = _fsdp(cfg, split, context, p) if par.fsdp else None
    return StepPlan(
        data=d, pipe=p, tensor=t, micro_batches=m, micro_batch=b, seq_len=mc.seq_len,
        num_layers=mc.num_layers, vocab=vocab, padded_vocab=layout.padded_vocab,
        sequence_parallel=layout.sequence_parallel, precision=tr.precision,
        recompute=Recompute(tr.recompute, tr.recompute_layers, tr.offload_activations), attention=layout.attention,
        deterministic=mc.dropout == 0 and mc.attention_dropout == 0,
        virtual_stages=layout.virtual_stages, schedule=schedule,
        distributed_optimizer=distributed, params=params, split=split,
        grid=layout.grid, tied=mc.tied, layout=layout, context=context, fsdp=fsdp,
        eod=-1 if eod is None else eod, document_masking=dc.document_masking, eod_mask_loss=dc.eod_mask_loss)
