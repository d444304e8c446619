"""What a restore checks before it reads any array: the same model, the same data, the same seed.

A checkpoint restores only into the model it was saved from (vocabulary padding, dropout
aside), a resume continues on the data it was trained on unless `data.allow_change=true`, and
with the seed it was saved with (its RNG key is restored, as Megatron restores its RNG state).
"""
from __future__ import annotations

from dataclasses import asdict, fields

from mtjax.checkpoint.errors import CheckpointError
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config, ModelConfig

# may differ from the checkpoint's on resume or generation: padding, regularisation, the attention
# kernel, the initialisation (the weights are restored) and the routing's training settings; every
# other model field shapes the weights or the function they compute
MODEL_KEYS_FREE = ("vocab_multiple", "dropout", "attention_dropout", "attention", "init_std", "moe_capacity_factor",
                   "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_rate")
DATA_KEYS = {"fingerprint": "data.path", "weights": "data.path", "tokenizer": "data.tokenizer", "seed": "data.seed",
             "valid_fraction": "data.valid_fraction"}


def _model_fields(model: dict) -> dict:
    """A saved `model` group as the model it describes: fields it lacks (saved before they existed)
    at their defaults, and the arch's defaults resolved (tie_embeddings null, activation "")."""
    known = {f.name for f in fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in model.items() if k in known})
    return {**model, **asdict(m), "tie_embeddings": m.tied, "activation": m.mlp_activation}


def check_same_model(saved: dict, cfg: Config, step: int, resumes: bool = False, meta: dict | None = None) -> None:
    """A checkpoint restores only into the model it was saved from (`MODEL_KEYS_FREE` aside; a
    rotary model's seq_len too, `length_free`), its seq_len within the sliding window its `meta`
    records (`check_window`). A run that `resumes` a trained step at another seq_len needs
    data.allow_change: its data position counts samples of the saved length (checked after the
    window, which allow_change could not pass)."""
    change = model_change(saved, cfg, length_free(saved))
    if change is not None:
        key, value, now = change
        raise CheckpointError(f"checkpoint step {step} was saved with model.{key}={value!r}, the config says {now!r}")
    if meta is not None:
        check_window(meta, cfg.model.seq_len, step)
    was, now = _model_fields(saved)["seq_len"], cfg.model.seq_len
    if resumes and step > 0 and was != now and not cfg.data.allow_change:
        raise ConfigError("model.seq_len", f"checkpoint step {step} was trained on samples of {was} tokens and its "
                                           f"data position counts them; set data.allow_change=true to go on with "
                                           f"samples of {now} (other samples than the run would have read next)")


def length_free(saved: dict) -> tuple[str, ...]:
    """("seq_len",) for a model without a position table (llama: rotary positions), whose weights
    and what they compute at a position do not depend on s (fine-tuning or generating at another
    length than a checkpoint's); () for GPT, whose learned table is [s, h]."""
    return ("seq_len",) if _model_fields(saved)["arch"] == "llama" else ()


def model_change(saved: dict, cfg: Config, free: tuple[str, ...] = ()) -> tuple[str, object, object] | None:
    """(field, the saved model's value, cfg's) for the first field outside `MODEL_KEYS_FREE` and
    `free` in which cfg's model is not the saved one (both resolved: `_model_fields`), or None."""
    saved, now = _model_fields(saved), _model_fields(cfg.to_dict()["model"])
    for key, value in saved.items():
        if key not in MODEL_KEYS_FREE + free and now.get(key) != value:
            return key, value, now.get(key)
    return None


def check_vocab(vocab, padded, model_vocab) -> None:
    """ValueError unless the `meta` item's V and V_p are whole numbers, 0 < V <= V_p < 2**31, and
    V is the saved model.vocab_size where that is set (0 takes the tokenizer's): a restore cuts
    and pads the vocabulary axes by them, so a wrong one would cut weights without a word."""
    whole = [isinstance(v, int) and not isinstance(v, bool) for v in (vocab, padded)]
    if not all(whole) or not 0 < vocab <= padded < 2**31:
        raise ValueError(f"vocab {vocab!r} and padded_vocab {padded!r} must be whole numbers with "
                         f"0 < vocab <= padded_vocab < 2**31")
    if model_vocab and model_vocab != vocab:
        raise ValueError(f"its vocab {vocab} is not its config's model.vocab_size {model_vocab!r}")


def check_same_data(saved: dict | None, now: dict | None, cfg: Config, step: int) -> None:
    """A resume continues on the data the checkpoint was trained on, unless data.allow_change=true:
    the corpora's content (fingerprint), the blend's weights, the tokenizer, the split seed and
    the held-out fraction. A blend and a single corpus differ in their fingerprints."""
    if not saved or not now or cfg.data.allow_change:
        return
    for item, key in DATA_KEYS.items():
        if item in saved and saved[item] != now.get(item):
            what = ("the token files differ" if item == "fingerprint" else
                    f"it was trained with the blend weights {_weights(saved[item])}, this run's are "
                    f"{_weights(now.get(item))}" if item == "weights" else
                    f"it was trained with {key}={saved[item]!r}, this run has {now.get(item)!r}")
            raise ConfigError(key, f"checkpoint step {step} was trained on other data: {what}; set "
                                   f"data.allow_change=true to go on with this data")


def check_same_seed(saved: dict, cfg: Config, step: int) -> None:
    """A resume restores the checkpoint's RNG key (the dropout stream, fold_in(key, step)) and its
    weights, so a train.seed other than the one it was saved with would have no effect: refused
    (ConfigError naming train.seed). A saved config without one (none is known) passes."""
    was = saved["train"].get("seed")
    if was is None or was == cfg.train.seed:
        return
    raise ConfigError("train.seed", f"checkpoint step {step} was saved with train.seed={was}, this run has "
                                    f"{cfg.train.seed}; a resume restores the checkpoint's weights and RNG key, so "
                                    f"the seed would have no effect: set train.seed={was}, or start from its "
                                    f"weights in a new run directory with train.init_from (fresh RNG key from "
                                    f"train.seed)")


def _weights(shares) -> str:
    return "none (one corpus)" if shares is None else " ".join(f"{w:.4g}" for w in shares)


def data_position(meta: dict, state, step: int) -> int:
    """The samples a checkpoint's run had consumed: `meta`'s exact count where the loop saved it,
    else (older checkpoints, conversions) the state's int32 read as unsigned; the two agree modulo
    2^32 (the state's count wraps after 2^31 samples: 8.8T tokens of s = 4096)."""
    wrapped = int(state.data_position)
    exact = meta.get("data_position", wrapped % (1 << 32))
    if not isinstance(exact, int) or exact < 0 or (exact - wrapped) % (1 << 32):
        raise CheckpointError(f"checkpoint step {step}: its data position {exact!r} (meta) disagrees with the "
                              f"state's {wrapped}")
    return exact


# meta entries about the weights' origin, kept by every checkpoint trained from them: the
# Hugging Face family from-hf converted (to-hf writes the same family back after fine-tuning), and
# the sliding window its layers attend within ({"window": W, "layers": [...]}, where one was set)
CARRIED_META = ("hf_family", "hf_sliding_window")


def carried(meta: dict) -> dict:
    """The entries of a checkpoint's `meta` that the checkpoints trained from it carry on: resumed
    from, or started from it by train.init_from."""
    return {key: meta[key] for key in CARRIED_META if isinstance(meta, dict) and key in meta}


def check_window_record(record, model: dict) -> None:
    """ValueError unless `record`, a checkpoint's meta hf_sliding_window, is absent (None) or
    {"window": W, "layers": [...]} as from-hf writes it: W a whole number, at least the saved
    model.seq_len (a conversion or run past W is refused), the sliding layers distinct whole numbers
    in [0, model.num_layers), at least one. `check_window` refuses by W and to-hf writes both back
    (`hf_window.window_keys`): a malformed one (an edited, resealed meta) would go unchecked there,
    or end to-hf in a traceback."""
    if record is None:
        return
    layers = record.get("layers") if isinstance(record, dict) else None
    seq_len, num_layers = model.get("seq_len"), model.get("num_layers")
    if not (isinstance(record, dict) and set(record) == {"window", "layers"} and _whole(record["window"])
            and _whole(seq_len) and record["window"] >= seq_len and isinstance(layers, list) and layers
            and all(_whole(i) for i in layers) and len(set(layers)) == len(layers)
            and _whole(num_layers) and all(0 <= i < num_layers for i in layers)):
        raise ValueError(f"{CARRIED_META[1]} {record!r} is not {{'window': W >= model.seq_len {seq_len!r}, 'layers': "
                         f"the sliding layers below model.num_layers {num_layers!r}}}")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_window(meta: dict, seq_len: int, step: int) -> None:
    """ConfigError naming model.seq_len when `seq_len` exceeds the sliding window W the checkpoint's
    weights attend within (`meta`'s hf_sliding_window, recorded by from-hf, carried on). Query i
    of a window-W layer sees keys i - W < j <= i; over s <= W positions that is every key j <= i,
    which is the full causal attention mtjax computes. Past W, mtjax would attend where the model
    never did: a run (init_from, resume) or generation at s > W is refused."""
    record = meta.get(CARRIED_META[1]) if isinstance(meta, dict) else None
    window = record.get("window") if isinstance(record, dict) else None
    if not isinstance(window, int) or seq_len <= window:
        return
    raise ConfigError("model.seq_len", f"{seq_len} is longer than the sliding window of {window} tokens that the "
                                       f"weights of checkpoint step {step} attend within (its Hugging Face "
                                       f"source's sliding_window); mtjax has no sliding-window attention and would "
                                       f"attend past it: set model.seq_len <= {window}")
