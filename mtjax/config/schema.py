"""The configuration schema: frozen dataclasses, one per group.

Every field carries a one-line comment; `validate.py` checks ranges and
divisibility in one pass, `load.py` reads YAML and dotted overrides.
Notation (see docs/design.md): b micro-batch, s sequence, h hidden, a heads,
k kv heads, l layers, V vocabulary, d/p/t data/pipe/tensor sizes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt"                 # "gpt" (LayerNorm, learned positions, GeLU) or "llama" (RMSNorm, RoPE, SwiGLU, GQA)
    num_layers: int = 2               # l
    hidden_size: int = 64             # h
    num_heads: int = 4                # a
    num_kv_heads: int = 0             # k; 0 means k = a (multi-head attention)
    ffn_hidden_size: int = 0          # f; 0 means 4h (gpt) or the multiple of 64 nearest 8h/3 (llama)
    seq_len: int = 64                 # s
    vocab_size: int = 0               # V before padding; 0 takes the tokenizer's
    vocab_multiple: int = 128         # V is padded to a multiple of vocab_multiple * t
    tie_embeddings: bool | None = None  # output layer reuses the input embedding; None: the arch's (gpt yes, llama no)
    kv_channels: int = 0              # d, the per-head dimension (Megatron's name); 0 means h/a
    activation: str = ""              # MLP: gelu (exact erf) | gelu_tanh (gpt), swiglu (llama); "" the arch's
    qkv_bias: bool = False            # biases on Q, K, V for llama (Qwen2); gpt always has every bias
    dropout: float = 0.0              # hidden dropout (after attention and MLP)
    attention_dropout: float = 0.0    # dropout on the attention probabilities
    attention: str = "auto"           # core attention: auto | xla | dot_product (model/core_attention.py)
    norm_eps: float = 1e-5            # LayerNorm / RMSNorm epsilon
    rope_theta: float = 10000.0       # rotary base (llama)
    rope_scaling: str = "none"        # rotary frequency scaling: none | linear | llama3 (Llama 3.1)
    rope_scaling_factor: float = 1.0  # linear: positions divided by it; llama3: low frequencies divided by it
    rope_low_freq_factor: float = 1.0   # llama3: wavelengths above original_positions/low are fully scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_positions/high are kept
    rope_original_positions: int = 8192  # llama3: the pre-training context (original_max_position_embeddings)
    init_std: float = 0.02            # normal init; output projections scaled by 1/sqrt(2l)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        """d: kv_channels, or h/a when it is 0."""
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def tied(self) -> bool:
        """Whether the output layer is the input embedding: tie_embeddings, or the arch's default."""
        return self.arch == "gpt" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def mlp_activation(self) -> str:
        """The MLP's activation: `activation`, or the arch's default (gelu, swiglu)."""
        return self.activation or ("swiglu" if self.arch == "llama" else "gelu")

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch == "llama":
            return 64 * max(1, round(8 * self.hidden_size / 3 / 64))
        return 4 * self.hidden_size


@dataclass(frozen=True)
class ParallelConfig:
    data: int = -1                    # d; -1 takes the devices left over by pipe and tensor
    pipe: int = 1                     # p
    tensor: int = 1                   # t
    sequence_parallel: bool = False   # shard norms/dropout/residual over tensor along s
    schedule: str = "1f1b"            # pipeline schedule: gpipe | 1f1b | interleaved | zb | zbv (split backward)
    virtual_stages: int = 1           # v, model chunks per pipeline stage (interleaved; zbv always has 2)
    max_in_flight: int = 0            # cap on the micro-batches a stage holds stashed (until B; split: until W); 0 = own
    distributed_optimizer: bool = False  # shard fp32 master weights and moments over data (ZeRO-1)
    tensor_grid: str = "1d"           # how `tensor` splits a layer: 1d (Megatron), 2d (q x q grid, t = q^2),
                                      # 2.5d (q x q x depth, t = q^2 depth); see mtjax/parallel/grid.py
    tensor_depth: int = 1             # 2.5d: the depth d of the grid (splits the batch, replicates weights)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3                  # peak learning rate
    min_lr: float = 1e-4              # floor of the cosine decay
    warmup_steps: int = 10            # linear warm-up from 0 to lr
    decay_steps: int = 0              # cosine decay length after warm-up; 0 means train.steps - warmup
    weight_decay: float = 0.1         # AdamW decoupled decay (not on norms and biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0            # global-norm clip; 0 disables


@dataclass(frozen=True)
class Corpus:
    """One corpus of a weighted blend: its PREFIX.bin/.idx and its weight (the blend normalises
    the weights: corpus k gets the share w_k / sum_j w_j of the samples)."""
    weight: float
    path: str


# data.path and data.valid_path: one prefix (a str, "" for the default), or a weighted blend,
# written `0.7 data/web 0.3 data/code` or as a YAML list of {weight, path} (config/data_path.py)
DataPath = str | tuple[Corpus, ...]


@dataclass(frozen=True)
class DataConfig:
    path: DataPath = ""               # a PREFIX of .bin/.idx, or a weighted blend; "" builds the standard-library corpus
    valid_path: DataPath = ""         # validation data (a prefix or a blend); "" holds out valid_fraction of path
    tokenizer: str = "byte"           # "byte" or a path to an HF tokenizer.json
    eod_token: str = ""               # the end-of-document token; "" the tokenizer's (its end-of-text token)
    bos_token: str = ""               # the beginning-of-document token; "" the tokenizer's, if it has one
    add_bos: bool = False             # the data puts BOS before every document (preprocess --add-bos)
    valid_fraction: float = 0.02      # fraction of documents held out for validation (without valid_path)
    seed: int = 1234                  # document and sample shuffling
    cache_dir: str = ".cache/mtjax"   # built corpora and sample indices
    allow_change: bool = False        # resume on data other than the checkpoint's (path, weights, tokenizer, seed, split)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100                  # optimizer steps
    global_batch: int = 16            # B = b * m * d sequences per step
    micro_batch: int = 4              # b (ignored when micro_batches is set)
    micro_batches: int = 0            # m per step; 0 derives m = B / (b d), else b = B / (m d)
    seed: int = 0                     # parameter init and dropout
    precision: str = "fp32"           # compute dtype: fp32 | bf16 | fp16
    recompute: str = "none"           # activation recomputation: none | selective | full | block
    recompute_layers: int = 0         # block mode: recompute (fully) the first N layers of each stage
    offload_activations: bool = False # keep saved activations in host memory (platforms with a host memory space)
    on_nonfinite: str = "stop"        # non-finite loss or gradients: stop (raise) | skip (drop the step)
    log_interval: int = 10            # steps between logged metrics
    eval_interval: int = 50           # steps between validation passes; 0 disables
    eval_batches: int = 4             # global batches per validation pass
    run_dir: str = "runs/default"     # metrics.jsonl, TensorBoard events, checkpoints
    init_from: str = ""               # a checkpoint (run, checkpoints or step dir) whose weights start the run at step 0
    progress: bool = True             # progress bar when attached to a terminal
    peak_tflops: float = 0.0          # per-device peak for MFU; 0 guesses from the device kind
    initial_loss_scale: float = 2.0 ** 32  # fp16 dynamic loss scale: starting value
    loss_scale_window: int = 1000     # fp16: finite steps before the scale doubles
    hysteresis: int = 2               # fp16: overflows tolerated before the scale halves
    min_loss_scale: float = 1.0       # fp16: the scale never drops below this


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 0                 # steps between saves; 0 saves only at the end
    keep: int = 2                     # newest checkpoints kept
    resume: bool = True               # continue from the newest complete checkpoint in run_dir
    overwrite: bool = False           # allow resume=false to discard existing checkpoints
    enabled: bool = True              # write checkpoints at all
    dir: str = ""                     # where checkpoints live; "" means <train.run_dir>/checkpoints
    async_save: bool = True           # write in the background while training continues


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: str = ""             # host:port of process 0; "" detects a cluster (SLURM) or runs one process
    num_processes: int = 0            # processes in the job; 0 takes it from the cluster environment
    process_id: int = -1              # this process; -1 takes it from the cluster environment


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def replace(self, **groups) -> "Config":
        return dataclasses.replace(self, **groups)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
