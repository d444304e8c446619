"""The configuration schema: frozen dataclasses, one per group.

Every field is declared with `doc(default, meaning)`: its one-line meaning is the field's metadata,
the one source of `python -m mtjax.config` and docs/config.md (`reference.py`). Each group's
docstring says what the group holds; the model group is in `model_schema.py`. `validate/` checks
ranges and divisibility, `load.py` reads YAML and dotted overrides. Notation (docs/design.md): b
micro-batch, s sequence, h hidden, a heads, k kv heads, l layers, V vocabulary, d/p/t data/pipe/
tensor sizes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mtjax.config.fields import doc
from mtjax.config.model_schema import ModelConfig    # (defined there, imported from here as before)


@dataclass(frozen=True)
class ParallelConfig:
    """The (data, pipe, context, tensor) mesh, sequence/context parallelism, schedules, ZeRO-1, FSDP, the tensor grid."""
    data: int = doc(-1, "d, data-parallel ranks; -1 takes the devices left over by pipe, context and tensor")
    pipe: int = doc(1, "p, pipeline stages")
    tensor: int = doc(1, "t, tensor-parallel ranks")
    sequence_parallel: bool = doc(False, "split norms, dropout and the residual stream over tensor along s")
    context: int = doc(1, "c, context-parallel ranks: every layer's sequence split c ways (load-balanced), attention "
                          "included")
    context_attention: str = doc("all_gather", "how attention crosses the context axis: all_gather (K, V gathered) | "
                                               "ring (K, V passed around)")
    schedule: str = doc("1f1b", "pipeline schedule: gpipe | 1f1b | interleaved | zb | zbv (zb, zbv: split backward)")
    virtual_stages: int = doc(1, "v, model chunks per pipeline stage (interleaved needs v >= 2; zbv always has 2)")
    max_in_flight: int = doc(0, "cap on the micro-batches a stage holds stashed (until B; split: until W); 0: the "
                                "schedule's own")
    distributed_optimizer: bool = doc(False, "split fp32 master weights and AdamW moments over data (ZeRO-1)")
    fsdp: bool = doc(False, "FSDP (ZeRO-3): the layers' weights stay split over data x context, each layer "
                     "gathered in the layer scan and its gradient reduce-scattered; implies distributed_optimizer")
    fsdp_keep_gathered: bool = doc(False, "fsdp: the backward reuses the forward's gathered layers instead of "
                                   "gathering again (ZeRO-2-like memory: every layer's weights held until its "
                                   "backward)")
    fsdp_pipeline_gather: str = doc("step", "fsdp with pipe > 1: step (each stage gathers its layers once a step and "
                                    "reduce-scatters their gradient sums once) | microbatch (each layer gathered and "
                                    "reduce-scattered in every micro-batch's layer scan: less memory, m times the "
                                    "traffic)")
    tensor_grid: str = doc("1d", "how tensor splits a layer: 1d (Megatron), 2d (q x q grid, t = q^2), "
                                 "2.5d (t = q^2 depth)")
    tensor_depth: int = doc(1, "2.5d: the depth of the grid (splits the batch, replicates weights)")
    expert: int = doc(1, "e, expert-parallel ranks: each MoE layer's experts split e ways over data x context")
    tensor_overlap: bool = doc(False, "hide sequence parallelism's all-gathers and reduce-scatters behind "
                               "the column and row matmuls (collective matmul, t ring steps; needs sequence_parallel); "
                               "predicted slower than the plain collectives on H100s at the shapes in "
                               "docs/benchmarks.md, 'Tensor-parallel overlap'")
    half_batch_overlap: bool = doc(False, "each layer runs its micro-batch as two halves, each half's tensor-parallel "
                                   "collectives fenced against the other half's matmuls (batch-split overlap; "
                                   "needs parallel.tensor > 1, and an even train.micro_batch unless half_batch_axis=sequence)")
    half_batch_group: int = doc(4, "with half_batch_overlap: consecutive layers interleaved as one unit, so the "
                                "halves' windows cross layer boundaries and only a unit's first all-gather waits "
                                "alone; a run of n layers uses gcd(half_batch_group, n)")
    half_batch_axis: str = doc("batch", "with half_batch_overlap: what is halved, the micro-batch's rows (batch) or "
                               "its sequence (sequence: the second half attends to the first's keys; for an odd "
                               "micro-batch, b = 1 included)")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, a decay (Megatron's --lr-decay-style) and global-norm clipping."""
    lr: float = doc(1e-3, "peak learning rate, reached at the end of the warm-up")
    min_lr: float = doc(1e-4, "where the decay ends, and the lr past it (unused by decay_style=constant)")
    warmup_steps: int = doc(10, "linear warm-up from lr_warmup_init to lr; at or past train.steps the run ends inside it "
                                "(lr below its peak, no decay): a longer run's start, continued by raising "
                                "train.steps on resume")
    lr_warmup_init: float = doc(0.0, "the lr at step 0, where the warm-up starts (Megatron's --lr-warmup-init); "
                                     "in [0, lr], needs warmup_steps > 0")
    decay_steps: int = doc(0, "decay length after warm-up (past it: min_lr, constant aside); 0 means "
                              "train.steps - warmup_steps")
    decay_style: str = doc("cosine", "the lr after the warm-up: cosine | linear (lr to min_lr) | constant (lr) | "
                                     "inverse_square_root (lr*sqrt(warmup_steps/step), at least min_lr) | "
                                     "wsd (lr, then its last wsd_decay_steps down to min_lr)")
    wsd_decay_steps: int = doc(0, "wsd: the final phase's steps, the end of the decay; 0 holds lr to the decay's end")
    wsd_decay_style: str = doc("exponential", "wsd: the final phase's shape at q in [0, 1]: linear (1-q) | cosine | "
                                              "exponential (2*0.5^q-1) | minus_sqrt (1-sqrt(q))")
    weight_decay: float = doc(0.1, "AdamW decoupled decay (not on norms and biases)")
    beta1: float = doc(0.9, "AdamW's first-moment decay")
    beta2: float = doc(0.95, "AdamW's second-moment decay")
    eps: float = doc(1e-8, "AdamW's epsilon in the denominator")
    clip_grad: float = doc(1.0, "global-norm clip; 0 disables")


@dataclass(frozen=True)
class Corpus:
    """One corpus of a weighted blend: PREFIX.bin/.idx and its weight (corpus k's share: w_k / sum_j w_j)."""
    weight: float
    path: str


# data.path and data.valid_path: one prefix (a str, "" for the default), or a weighted blend,
# written `0.7 data/web 0.3 data/code` or as a YAML list of {weight, path} (config/data_path.py)
DataPath = str | tuple[Corpus, ...]


@dataclass(frozen=True)
class DataConfig:
    """Token files or blends of them, the validation set, the tokenizer and its special tokens."""
    path: DataPath = doc("", 'a PREFIX of .bin/.idx, or a weighted blend ("0.7 a 0.3 b"); "" builds the '
                             'standard-library corpus')
    valid_path: DataPath = doc("", 'validation data (a prefix or a blend); "" holds out valid_fraction of path')
    tokenizer: str = doc("byte", "byte, or a path to a Hugging Face tokenizer.json")
    eod_token: str = doc("", 'the end-of-document token; "" the tokenizer\'s (its end-of-text token)')
    bos_token: str = doc("", 'the beginning-of-document token; "" the tokenizer\'s, if it has one')
    add_bos: bool = doc(False, "the data puts BOS before every document (preprocess --add-bos)")
    valid_fraction: float = doc(0.02, "fraction of documents held out for validation (without valid_path)")
    seed: int = doc(1234, "document and sample shuffling")
    cache_dir: str = doc(".cache/mtjax", "built corpora and sample indices (relative: to the working directory)")
    allow_change: bool = doc(False, "resume on data other than the checkpoint's (path, weights, tokenizer, seed, "
                                    "split)")
    document_masking: bool = doc(False, "packed rows: attention and positions restart at every end-of-document "
                                        "token; no loss on the label after it")
    eod_mask_loss: bool = doc(False, "no loss where the input is the end-of-document token (stream rows; implied by "
                                     "document_masking)")


@dataclass(frozen=True)
class TrainConfig:
    """Steps and batch, seed, precision, recomputation, logging and validation, the run directory."""
    steps: int = doc(100, "optimizer steps")
    global_batch: int = doc(16, "B = b * m * d sequences per step")
    micro_batch: int = doc(4, "b; when micro_batches is set, b = B / (m d): a micro_batch written in the same "
                                 "layer (file or overrides) must agree, an earlier layer's yields")
    micro_batches: int = doc(0, "m per step; 0 derives m = B / (b d), else b = B / (m d)")
    seed: int = doc(0, "parameter init and dropout; a resume keeps the checkpoint's (another is refused)")
    precision: str = doc("fp32", "compute dtype: fp32 | bf16 | fp16 (master weights and optimizer stay fp32)")
    recompute: str = doc("none", "activation recomputation: none | selective | full | block")
    recompute_layers: int = doc(0, "block mode: recompute (fully) the first N layers of each model chunk "
                                   "(a stage's, or each of its v chunks)")
    offload_activations: bool = doc(False, "keep saved activations in pinned host memory (GPU; not with full)")
    on_nonfinite: str = doc("stop", "non-finite loss or gradients: stop (end the run) | skip (drop the step)")
    profile: bool = doc(False, "trace steps profile_step_start .. profile_step_end - 1 with JAX's profiler into "
                               "<run_dir>/profile (TensorBoard's profile plugin; process 0)")
    profile_step_start: int = doc(10, "profile: the first step traced (steps count from 1)")
    profile_step_end: int = doc(12, "profile: the step after the last traced (Megatron's --profile-step-end)")
    exit_duration_min: float = doc(0.0, "minutes after the run starts (setup and compile included) past which it "
                                        "saves and stops at the next step boundary, as a signal would (Megatron's "
                                        "--exit-duration-in-mins); 0: no limit")
    log_interval: int = doc(10, "steps between logged metrics (the last step is always logged)")
    eval_interval: int = doc(50, "steps between validation passes, and one at the last step; 0 disables")
    eval_batches: int = doc(4, "global batches per validation pass")
    run_dir: str = doc("runs/default", "config.json, metrics.jsonl, TensorBoard events (tb/), checkpoints")
    init_from: str = doc("", "a checkpoint (run, checkpoints or step dir) whose weights start the run at step 0")
    progress: bool = doc(True, "a progress bar instead of one line per logged step, when stderr is a terminal")
    peak_tflops: float = doc(0.0, "per-device peak TFLOP/s for MFU; 0: a known GPU's dense bf16 peak (no MFU on CPU)")
    loss_scale: float = doc(0.0, "fp16 static loss scale (Megatron's --loss-scale), overflows still skipped; 0: dynamic")
    initial_loss_scale: float = doc(2.0 ** 32, "fp16 dynamic loss scale: starting value")
    loss_scale_window: int = doc(1000, "fp16: finite steps before the scale doubles")
    hysteresis: int = doc(2, "fp16: from the N-th overflow (N this value) since the last growth, each halves the scale")
    min_loss_scale: float = doc(1.0, "fp16: the scale never drops below this")


@dataclass(frozen=True)
class CheckpointConfig:
    """When and where checkpoints are written, how many are kept, and resuming."""
    interval: int = doc(0, "steps between saves; 0 saves only at the end")
    keep: int = doc(2, "newest checkpoints kept")
    resume: bool = doc(True, "continue from the newest complete checkpoint in run_dir")
    overwrite: bool = doc(False, "a run that would not resume the checkpoints there (resume or enabled false) "
                          "discards them first; without it such a run is refused")
    enabled: bool = doc(True, "write checkpoints at all")
    dir: str = doc("", 'where checkpoints live; "" means <train.run_dir>/checkpoints')
    async_save: bool = doc(True, "write in the background while training continues")


@dataclass(frozen=True)
class DistributedConfig:
    """Several processes in one job: how they find each other."""
    coordinator: str = doc("", 'host:port of process 0; "" detects a cluster (SLURM, Open MPI) or runs one process')
    num_processes: int = doc(0, "processes in the job; 0 takes it from the cluster environment")
    process_id: int = doc(-1, "this process; -1 takes it from the cluster environment")
    join_timeout_s: int = doc(300, "seconds a process waits for the coordinator and its peers when joining")
    heartbeat_timeout_s: int = doc(100, "seconds without a process's heartbeat before JAX takes it for dead and "
                                        "ends the job")
    shutdown_timeout_s: int = doc(300, "seconds a process that has finished waits at exit for its peers to finish")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    written: frozenset[str] = field(default=frozenset(), compare=False, repr=False)   # keys given: `load.layered`

    @classmethod
    def groups(cls) -> tuple[str, ...]:
        """The config groups' names, in the schema's order (every field but `written`)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "written")

    def replace(self, **groups) -> "Config":
        return dataclasses.replace(self, **groups)

    def set_keys(self) -> frozenset[str]:
        """The 'group.field' keys whose value differs from the schema's default: what a Config built
        in Python (which has no `written` record) shows of what its author set."""
        return frozenset(f"{group}.{f.name}" for group in self.groups()
                         for f in dataclasses.fields(getattr(self, group))
                         if f.default is not dataclasses.MISSING and getattr(getattr(self, group), f.name) != f.default)

    def to_dict(self) -> dict:
        """{group: {field: value}}: the settings; `written` (how they were given, out of ==) is not one."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in self.groups()}
