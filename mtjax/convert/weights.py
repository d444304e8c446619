"""Hugging Face tensors <-> mtjax's parameter leaves, from one table per model family.

Each `Tensor` row names one HF tensor and the mtjax leaves it holds. The rules:
  - torch Linear weights are [out, in]; GPT-2's Conv1D weights and mtjax kernels are [in, out];
  - an mtjax kernel splits its input and output into named axes: q [h, a, d] is [h, a d],
    o [a, d, h] is [a d, h] (`inputs` = 2 leading axes on the input side);
  - a fused tensor holds several leaves side by side along its output axis: GPT-2's c_attn
    [h, 3h] is q | k | v, each head-major (column = head d + j, as mtjax's [a, d] reshapes it);
  - the vocabulary axis is zero-padded to mtjax's V_p (a multiple of vocab_multiple) and cut
    back to V on the way out; the padded rows never carry probability;
  - per-layer tensors (`{i}` in the name) stack along mtjax's leading `layers` axis, and
    per-expert ones (`{j}`, `hf_moe.py`) along the `experts` axis after it ([l, E, ...]); every
    expert's tensor must be there, and none beyond E.
Rotary embeddings: transformers' Llama and Qwen weights already use the rotate-half convention
(pairs (x_i, x_{i+d/2})) that mtjax/model/rotary.py uses, so q and k are not permuted.

Leaves are named by their path in the parameter tree, "layers/attn/q/kernel".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from mtjax.convert import hf_moe
from mtjax.data.errors import DataError

FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Tensor:
    name: str                       # the HF tensor; "{i}" stands for the layer, "{j}" for the expert
    leaves: tuple[str, ...]         # mtjax leaves, side by side along the tensor's output axis
    transpose: bool = False         # a torch Linear weight, [out, in]
    inputs: int = 1                 # leading axes of a leaf (per layer) on the input side; 0: a vector
    vocab_axis: int | None = None   # the leaves' vocabulary axis (per layer)

    @property
    def layered(self) -> bool:
        return "{i}" in self.name

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.name


def _vec(name: str, *leaves: str) -> Tensor:
    return Tensor(name, leaves, inputs=0)


def _gpt2(tied: bool) -> list[Tensor]:
    h = "transformer.h.{i}."
    rows = [Tensor("transformer.wte.weight", ("embed/embedding",), vocab_axis=0),
            Tensor("transformer.wpe.weight", ("pos_embedding",)),
            _vec(h + "ln_1.weight", "layers/ln_attn/scale"), _vec(h + "ln_1.bias", "layers/ln_attn/bias"),
            Tensor(h + "attn.c_attn.weight", ("layers/attn/q/kernel", "layers/attn/k/kernel", "layers/attn/v/kernel")),
            _vec(h + "attn.c_attn.bias", "layers/attn/q/bias", "layers/attn/k/bias", "layers/attn/v/bias"),
            Tensor(h + "attn.c_proj.weight", ("layers/attn/o/kernel",), inputs=2),
            _vec(h + "attn.c_proj.bias", "layers/attn/o/bias"),
            _vec(h + "ln_2.weight", "layers/ln_mlp/scale"), _vec(h + "ln_2.bias", "layers/ln_mlp/bias"),
            Tensor(h + "mlp.c_fc.weight", ("layers/mlp/fc1/kernel",)),
            _vec(h + "mlp.c_fc.bias", "layers/mlp/fc1/bias"),
            Tensor(h + "mlp.c_proj.weight", ("layers/mlp/fc2/kernel",)),
            _vec(h + "mlp.c_proj.bias", "layers/mlp/fc2/bias"),
            _vec("transformer.ln_f.weight", "ln_final/scale"), _vec("transformer.ln_f.bias", "ln_final/bias")]
    return rows + ([] if tied else [Tensor("lm_head.weight", ("lm_head/kernel",), transpose=True, vocab_axis=1)])


def _llama(tied: bool, qkv_bias: bool, qk_norm: bool, moe: str = "", mixed: bool = False) -> list[Tensor]:
    layer = "model.layers.{i}."
    rows = [Tensor("model.embed_tokens.weight", ("embed/embedding",), vocab_axis=0),
            _vec(layer + "input_layernorm.weight", "layers/ln_attn/scale")]
    for x in "qkv":
        rows.append(Tensor(layer + f"self_attn.{x}_proj.weight", (f"layers/attn/{x}/kernel",), transpose=True))
        if qkv_bias:
            rows.append(_vec(layer + f"self_attn.{x}_proj.bias", f"layers/attn/{x}/bias"))
    if qk_norm:     # Qwen3's per-head norms, one [d] each
        rows += [_vec(layer + f"self_attn.{x}_norm.weight", f"layers/attn/{x}_norm/scale") for x in "qk"]
    rows += [Tensor(layer + "self_attn.o_proj.weight", ("layers/attn/o/kernel",), transpose=True, inputs=2),
             _vec(layer + "post_attention_layernorm.weight", "layers/ln_mlp/scale"),
             _vec("model.norm.weight", "ln_final/scale")]
    if moe:
        rows += hf_moe.moe_rows(moe, Tensor, _vec)
    if mixed or not moe:   # a mixed model's dense layers (`hf_moe.py`)
        rows += [Tensor(layer + f"mlp.{x}_proj.weight", (f"layers/mlp/{leaf}/kernel",), transpose=True)
                 for x, leaf in (("gate", "gate"), ("up", "up"), ("down", "fc2"))]
    return rows + ([] if tied else [Tensor("lm_head.weight", ("lm_head/kernel",), transpose=True, vocab_axis=1)])


def table(family: str, tied: bool, mixed: bool = False) -> list[Tensor]:
    """The rows of `family` ('gpt2', 'llama', 'mistral' (Llama's), 'qwen2', 'qwen3', 'mixtral', 'qwen2_moe' or
    'qwen3_moe');
    `mixed`: dense layers among the MoE layers (`hf_moe.mixed`)."""
    if family == "gpt2":
        return _gpt2(tied)
    moe = family if family in hf_moe.FAMILIES.values() else ""
    return _llama(tied, qkv_bias=family in ("qwen2", "qwen2_moe"), qk_norm=family in ("qwen3", "qwen3_moe"),
                  moe=moe, mixed=mixed)


# Tensors HF files may hold that are not parameters: GPT-2's causal-mask buffers and old rotary
# caches (older transformers saved them), and a tied output layer's copy of the embedding.
IGNORED = {"gpt2": r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",
           **{f: r".*rotary_emb\.inv_freq" for f in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                                                     "qwen3_moe")}}


def _per_layer(shape: tuple[int, ...], row: Tensor, vocab: int) -> tuple[int, ...]:
    """A leaf's shape for one layer (and one expert), with the vocabulary axis at the true V."""
    shape = tuple(shape[1 + row.per_expert:] if row.layered else shape)
    if row.vocab_axis is not None:
        shape = shape[:row.vocab_axis] + (vocab,) + shape[row.vocab_axis + 1:]
    return shape


def _hf_shape(row: Tensor, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    outs = sum(math.prod(s[row.inputs:]) for s in shapes)
    if row.inputs == 0:
        return (outs,)
    ins = math.prod(shapes[0][:row.inputs])
    return (outs, ins) if row.transpose else (ins, outs)


def _pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """x with zero rows appended along `axis` up to `size`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


def _take(tensors: dict, name: str, source: str) -> np.ndarray:
    if name not in tensors:
        raise DataError(f"{source}: no tensor {name}, which the config.json model has")
    x = tensors.pop(name)
    if x.dtype.name not in FLOATS:
        raise DataError(f"{source}: {name} has dtype {x.dtype.name}; only float weights convert "
                        f"({', '.join(FLOATS)})")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"{source}: {name} holds non-finite values")
    return x


def _base_model_names(tensors: dict, family: str, tied: bool, source: str) -> None:
    """A base model's checkpoint (GPT2Model, LlamaModel, Qwen2Model, ...: no name starts with the
    `base_model_prefix`, "transformer" or "model") renamed in place as transformers' from_pretrained
    of the *ForCausalLM reads it: every name under the prefix. Such a file has no output layer:
    the tied embedding is one, and without tying transformers would draw a random one (refused)."""
    prefix = "transformer" if family == "gpt2" else "model"
    if any(n.startswith(prefix) for n in tensors):
        return
    if not tied and "lm_head.weight" not in tensors:
        raise DataError(f"{source}: no tensor lm_head.weight: the file holds a base model's weights (names without "
                        f"'{prefix}.'), which have no output layer, and config.json's tie_word_embeddings is false")
    for name in [n for n in tensors if not n.startswith("lm_head.")]:
        tensors[f"{prefix}.{name}"] = tensors.pop(name)


def _units(row: Tensor, num_layers: int, experts: int, model=None) -> list[list[str]]:
    """The HF names of `row`, one list per layer (one name per expert), or [[name]]; a mixed
    `model` (`hf_moe.mixed`): of the layers of the row's kind (`hf_moe.layers_of`)."""
    if not row.layered:
        return [[row.name]]
    layers = hf_moe.layers_of(row.leaves[0], model) if model is not None and hf_moe.mixed(model) else range(num_layers)
    return [[row.name.format(i=i, j=j) for j in range(experts if row.per_expert else 1)] for i in layers]


def to_leaves(tensors: dict[str, np.ndarray], family: str, tied: bool, num_layers: int,
              shapes: dict[str, tuple[int, ...]], vocab: int, source: str, model=None,
              unbuilt: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """HF tensors -> {leaf path: fp32 array in mtjax's shape `shapes[path]`}. DataError (naming
    `source`, the weights' files) for a missing, misshapen or unexpected tensor (an expert's
    among them: every one of the E is needed, and one beyond E is unexpected). A mixed `model`:
    the leaves per kind (`hf_moe.to_tree` stores them). `unbuilt`: patterns of tensors left over
    that transformers' class drops (`hf_families.unbuilt_tensors`). Consumes `tensors`: each is dropped once
    converted, so the HF arrays and the fp32 leaves are never all held at once."""
    _base_model_names(tensors, family, tied, source)
    out = {leaf: np.zeros(shapes[leaf], np.float32) for leaf in hf_moe.ZERO_LEAVES if leaf in shapes}
    for row in table(family, tied, model is not None and hf_moe.mixed(model)):
        per_unit = [_per_layer(shapes[leaf], row, vocab) for leaf in row.leaves]
        experts = shapes[row.leaves[0]][1] if row.per_expert else 1
        parts = {leaf: [] for leaf in row.leaves}
        for names in _units(row, num_layers, experts, model):
            pieces = [_split(_take(tensors, name, source), name, row, per_unit, source) for name in names]
            for k, leaf in enumerate(row.leaves):
                parts[leaf].append(np.stack([p[k] for p in pieces]) if row.per_expert else pieces[0][k])
        for leaf, pieces in parts.items():
            stacked = np.stack(pieces) if row.layered else pieces[0]
            if row.vocab_axis is not None:           # (vocabulary leaves are never per layer)
                stacked = _pad(stacked, row.vocab_axis, shapes[leaf][row.vocab_axis])
            out[leaf] = np.ascontiguousarray(stacked)
    ignored = re.compile("|".join((IGNORED[family], *unbuilt)))
    if tied:
        tensors.pop("lm_head.weight", None)      # transformers ties it to the embedding whatever it holds
    unexpected = sorted(n for n in tensors if not ignored.fullmatch(n))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise DataError(f"{source}: unexpected tensor {unexpected[0]}{more}: the config.json model has no such "
                        "parameter in mtjax")
    return out


def _split(x: np.ndarray, name: str, row: Tensor, per_unit: list, source: str) -> list[np.ndarray]:
    """One HF tensor -> its leaves' pieces (one layer, one expert), shape-checked."""
    want = _hf_shape(row, per_unit)
    if x.shape != want:
        raise DataError(f"{source}: {name} has shape {list(x.shape)}, config.json implies {list(want)}")
    x = x.T if row.transpose else x
    cuts = np.cumsum([math.prod(s[row.inputs:]) for s in per_unit])[:-1]
    return [piece.reshape(shape) for piece, shape in zip(np.split(x, cuts, axis=-1), per_unit)]


def from_leaves(leaves: dict[str, np.ndarray], family: str, tied: bool, num_layers: int,
                vocab: int, model=None) -> dict[str, np.ndarray]:
    """The inverse of `to_leaves`: {leaf path: array} -> HF tensors, the vocabulary cut to V."""
    out = {}
    for row in table(family, tied, model is not None and hf_moe.mixed(model)):
        experts = np.shape(leaves[row.leaves[0]])[1] if row.per_expert else 1
        for i, names in enumerate(_units(row, num_layers, experts, model)):
            for j, name in enumerate(names):
                parts = []
                for leaf in row.leaves:
                    x = np.asarray(leaves[leaf])
                    x = x[i, j] if row.per_expert else x[i] if row.layered else x
                    if row.vocab_axis is not None:
                        x = np.take(x, np.arange(vocab), axis=row.vocab_axis)
                    parts.append(x.reshape(math.prod(x.shape[:row.inputs]), -1) if row.inputs else x.reshape(-1))
                x = np.concatenate(parts, axis=-1)
                out[name] = np.ascontiguousarray(x.T if row.transpose else x)
    return out


def covered(family: str, tied: bool, mixed: bool = False) -> set[str]:
    """The leaves the table fills, and the zero ones an MoE family adds (compared with the model's
    own, to catch a model that grew one)."""
    zeros = set(hf_moe.ZERO_LEAVES) if family in hf_moe.FAMILIES.values() else set()
    return {leaf for row in table(family, tied, mixed) for leaf in row.leaves} | zeros
