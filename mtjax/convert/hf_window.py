"""config.json's sliding-window keys: whether any layer's attention is narrower than full causal
attention over the model's context, which mtjax cannot compute (`hf_config.read_model` calls it);
the window of one that converts, as the checkpoint records it, and its keys written back (to-hf).

A layer with window W lets query i attend to keys j with i - W < j <= i (transformers'
`sliding_window_overlay`; older flash-attention paths let one more through, i - W <= j). Over a
context of S = model.seq_len tokens, i - j <= S - 1, so a window W >= S masks nothing and the layer
is plain causal attention: such a checkpoint converts exactly, for every sequence mtjax can run
(training, logits and generation all stay within seq_len). Which layers use the window, as
transformers builds them:

    qwen2, qwen3   window = sliding_window (default 4096) if use_sliding_window else none; layer i
                   slides when layer_types[i] == "sliding_attention", or, without layer_types (as
                   transformers 4 always did), when a window is set and i >= max_window_layers
                   (default 28)
    qwen2_moe      the same keys, but the rule for which layers slide has changed between versions:
                   with use_sliding_window every layer is taken to slide, unless layer_types says
    qwen3_moe      window = sliding_window (default 4096) if use_sliding_window else none, every layer
    mixtral        window = sliding_window (default none), every layer
    mistral        window = sliding_window (absent: 4096, MistralConfig's default; null: none), every
                   layer
    llama          no window; layer_types may only say full_attention

Mistral, Mixtral and Qwen3-MoE do not read layer_types (`ONE_MASK`: their models build one mask
for every layer from sliding_window, and Qwen3MoeAttention drops its layer type), so a list there
changes nothing.

transformers 5 takes the sliding layers from layer_types and 4 (which never saved it) from the
window keys; a Qwen2 or Qwen3 config.json whose two spellings disagree is refused where the window
matters. A sliding layer without a window (layer_types saying "sliding_attention" where
use_sliding_window is false) is refused: transformers has no window to build its mask from.
"""
from __future__ import annotations

from mtjax.config.errors import ConfigError

KINDS = ("full_attention", "sliding_attention")
QWEN_DENSE = ("qwen2", "qwen3")
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
ONE_MASK = ("mistral", "mixtral", "qwen3_moe")     # one window for every layer, layer_types unread


def _layer_types(hf: dict, layers: int) -> list[str] | None:
    types = hf.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers or not all(t in KINDS for t in types):
        raise ConfigError("layer_types", f"must list {' or '.join(KINDS)} for each of the {layers} layers, "
                                         f"got {types!r}")
    return types


def _window(hf: dict, family: str, get) -> int | None:
    """The window config.json sets (None: none), as transformers' config class reads it."""
    if family in QWEN_DENSE + QWEN_MOE:
        if not get(hf, "use_sliding_window", bool, False):
            return None
        # absent: the class's 4096; null: no window
        return get(hf, "sliding_window", int, None, size=True) if "sliding_window" in hf else 4096
    if family == "mixtral":
        return get(hf, "sliding_window", int, None, size=True)
    if family == "mistral":
        return get(hf, "sliding_window", int, None, size=True) if "sliding_window" in hf else 4096
    return None


def _by_rule(hf: dict, family: str, layers: int, window: int | None, get) -> list[int]:
    """The sliding layers as use_sliding_window / max_window_layers / sliding_window say."""
    if window is None:
        return []
    if family in QWEN_DENSE:
        return list(range(max(get(hf, "max_window_layers", int, 28), 0), layers))
    return list(range(layers))


def sliding_layers(hf: dict, family: str, get) -> tuple[list[int], list[int] | None, int | None]:
    """(the sliding layers by the window keys, by layer_types (None when absent), the window W or None)."""
    layers = get(hf, "num_hidden_layers", int, size=True)
    types = None if family in ONE_MASK else _layer_types(hf, layers)
    window = _window(hf, family, get)
    listed = None if types is None else [i for i, t in enumerate(types) if t == "sliding_attention"]
    return _by_rule(hf, family, layers, window, get), listed, window


def _named(layers: list[int]) -> str:
    if len(layers) == 1:
        return f"layer {layers[0]}"
    run = layers == list(range(layers[0], layers[-1] + 1))
    return f"layers {layers[0]}-{layers[-1]}" if run else f"layers {layers}"


def check_windows(hf: dict, family: str, seq_len: int, get) -> None:
    """ConfigError naming config.json's key unless every layer is full causal attention over
    `seq_len` tokens (no window, or one of at least `seq_len`). transformers 5 takes the sliding
    layers from layer_types, 4 from the window keys: given both, they must agree where it matters."""
    by_rule, listed, window = sliding_layers(hf, family, get)
    sliding = by_rule if listed is None else listed
    if listed and window is None:
        raise ConfigError("layer_types", f"lists {_named(listed)} as sliding_attention, but config.json sets no "
                                         "sliding_window (use_sliding_window is false)")
    if window is None or window >= seq_len:
        return
    if listed is not None and family in QWEN_DENSE and listed != by_rule:
        raise ConfigError("layer_types", f"its sliding layers {listed} disagree with use_sliding_window and "
                                         f"max_window_layers (layers {by_rule}), which transformers 4 reads instead")
    if sliding:
        key = "sliding_window" if family in ("mixtral", "mistral") or "sliding_window" in hf else "use_sliding_window"
        value = repr(hf[key]) if key in hf else f"absent (so {window})"
        raise ConfigError(key, f"{value} is not supported: {_named(sliding)} "
                               f"{'attends' if len(sliding) == 1 else 'attend'} within a window of {window} "
                               f"tokens, fewer than the {seq_len} positions of the model (max_position_embeddings, "
                               "or --seq-len), and mtjax has no sliding-window attention")


# ---------------------------------------------------------------- the window a conversion keeps

def recorded_window(hf: dict, family: str, get) -> dict | None:
    """{"window": W, "layers": the sliding layers} of a config.json whose window converted (it
    covers the context: `check_windows`), as the checkpoint's meta keeps it, or None where no
    layer slides. The weights were trained to attend within W: a later run or generation over
    more than W positions is refused (`checkpoint.compat.check_window`), and to-hf writes it back
    (`window_keys`)."""
    by_rule, listed, window = sliding_layers(hf, family, get)
    sliding = by_rule if listed is None else listed
    return {"window": window, "layers": sliding} if window is not None and sliding else None


def window_keys(record: dict | None, family: str, layers: int) -> dict:
    """config.json's sliding-window keys for `record` (from `recorded_window`; None: no window,
    {}) in `family`'s spelling. Mistral and Mixtral slide every layer by sliding_window; the Qwen
    families need use_sliding_window too, and take the sliding layers from layer_types
    (transformers 5; Qwen3-MoE reads none: every layer) or, in transformers 4, as the layers from
    max_window_layers on (the first sliding layer: exact where they run to the last). Llama and
    GPT-2 have no window: written as one of them (to-hf's --family llama of a Mistral) the model
    is the same over its max_position_embeddings = model.seq_len <= W positions, and the window
    is dropped."""
    if record is None or family in ("llama", "gpt2"):
        return {}
    window, sliding = record["window"], record["layers"]
    if family in ("mistral", "mixtral"):
        return {"sliding_window": window}
    keys = {"use_sliding_window": True, "sliding_window": window, "max_window_layers": min(sliding)}
    return keys if family in ONE_MASK else keys | {"layer_types": [KINDS[i in sliding] for i in range(layers)]}
