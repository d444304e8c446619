"""The mixture-of-experts fields of `model` and `parallel.expert`: the router's options, the
experts' split over e of the d c replicas, and the layouts the MoE layer does not run on yet."""
from __future__ import annotations

from mtjax.config.schema import Config, ModelConfig
from mtjax.config.validate.common import check, divides, no_effect, spelled
from mtjax.pipeline.schedules import chunks_per_stage

SCORES = ("softmax", "sigmoid")
MOE_FIELDS = ("moe_top_k", "moe_ffn_hidden_size", "moe_layer_freq", "moe_first_dense", "moe_shared_expert_size",
              "moe_shared_expert_gate",
              "moe_capacity_factor", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_score", "moe_renormalize",
              "moe_router_bias", "moe_router_bias_rate")
EXPERTS = "mixture of experts (model.num_experts > 0)"


def validate_moe(cfg: Config, d: int, t: int, p: int = 1) -> None:
    """The router and experts; e divides E and the d c replicas it is taken from; the dense
    layers among the MoE layers fit p pipeline stages."""
    m, par = cfg.model, cfg.parallel
    check(m.num_experts >= 0, "model.num_experts", f"must be >= 0 (0 = dense), got {m.num_experts}")
    check(par.expert >= 1, "parallel.expert", f"must be >= 1, got {par.expert}")
    if not m.moe:
        for name in MOE_FIELDS:   # set away from its default, it would be ignored
            no_effect(getattr(m, name) == getattr(ModelConfig, name), f"model.{name}",
                      f"{name} = {spelled(getattr(m, name))}", EXPERTS)
        no_effect(par.expert == 1, "parallel.expert", f"expert = {par.expert}", EXPERTS)
        return
    _validate_router(m)
    e, replicas = par.expert, d * par.context
    divides(e, m.num_experts, "parallel.expert", f"expert {e} does not divide model.num_experts {m.num_experts}")
    how = f"data*context = {d}*{par.context}" if par.context > 1 else f"data {d}"
    divides(e, replicas, "parallel.expert", f"expert {e} does not divide {how} (experts are split over the "
                                            "data-parallel replicas)")
    check(m.moe_ffn_hidden_size >= 0, "model.moe_ffn_hidden_size", "must be >= 0")
    check(m.moe_shared_expert_size >= 0, "model.moe_shared_expert_size", "must be >= 0")
    divides(t, m.expert_ffn_size, "model.moe_ffn_hidden_size",
            f"expert ffn size {m.expert_ffn_size} is not divisible by parallel.tensor {t}")
    no_effect(not m.moe_shared_expert_gate or m.moe_shared_expert_size > 0, "model.moe_shared_expert_gate",
              "moe_shared_expert_gate = true", "a shared expert (model.moe_shared_expert_size > 0)")
    divides(t, m.moe_shared_expert_size or t, "model.moe_shared_expert_size",
            f"shared expert size {m.moe_shared_expert_size} is not divisible by parallel.tensor {t}")
    _validate_pattern(cfg, p)
    _not_yet(cfg)


def _validate_pattern(cfg: Config, p: int) -> None:
    """The layers scan as a dense prefix and units of f layers (`model/layer_pattern.py`): f divides
    l and a pipeline chunk's layers; a prefix only without block recomputation."""
    m, tr = cfg.model, cfg.train
    f, k = m.moe_layer_freq, m.moe_first_dense
    divides(f, m.num_layers, "model.moe_layer_freq", f"num_layers {m.num_layers} is not divisible by "
                                                     f"moe_layer_freq {f} (the layers scan in units of {f})")
    if p > 1:   # the prefix runs on the first stage, with the embedding
        local = (m.num_layers - m.dense_prefix) // (p * chunks_per_stage(cfg.parallel.schedule,
                                                                        cfg.parallel.virtual_stages))
        divides(f, local, "model.moe_layer_freq", f"moe_layer_freq {f} does not divide the {local} layers of a "
                                                  "pipeline chunk (every stage runs whole units)")
    if tr.recompute == "block":
        check(k < f, "train.recompute", "block recomputation with dense layers before the units "
                                        "(moe_first_dense >= moe_layer_freq) is not implemented: use full or selective")
        divides(f, tr.recompute_layers, "train.recompute_layers", f"recompute_layers {tr.recompute_layers} is not "
                                                                  f"a multiple of moe_layer_freq {f} (whole units)")


def _validate_router(m: ModelConfig) -> None:
    check(m.moe_top_k >= 1, "model.moe_top_k", f"must be >= 1, got {m.moe_top_k}")
    check(m.moe_top_k <= m.num_experts, "model.moe_top_k",
          f"top_k {m.moe_top_k} is more than model.num_experts {m.num_experts}")
    check(m.moe_capacity_factor >= 0, "model.moe_capacity_factor",
          f"must be >= 0 (0 = dropless), got {m.moe_capacity_factor}")
    check(m.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", f"must be >= 0, got {m.moe_aux_loss_coeff}")
    check(m.moe_z_loss_coeff >= 0, "model.moe_z_loss_coeff", f"must be >= 0, got {m.moe_z_loss_coeff}")
    check(m.moe_score in SCORES, "model.moe_score", f"must be one of {', '.join(SCORES)}, got {m.moe_score!r}")
    check(not m.moe_router_bias or m.moe_score == "sigmoid", "model.moe_router_bias",
          "aux-loss-free balancing biases sigmoid scores (Megatron's rule): set model.moe_score=sigmoid")
    no_effect(m.moe_router_bias or m.moe_router_bias_rate == ModelConfig.moe_router_bias_rate,
              "model.moe_router_bias_rate", f"moe_router_bias_rate = {m.moe_router_bias_rate}",
              "model.moe_router_bias=true")
    check(m.moe_layer_freq >= 1, "model.moe_layer_freq", f"must be >= 1, got {m.moe_layer_freq}")
    check(0 <= m.moe_first_dense < m.num_layers, "model.moe_first_dense",
          f"must be in [0, num_layers {m.num_layers}), got {m.moe_first_dense}")


def _not_yet(cfg: Config) -> None:
    """What the MoE layer does not implement yet: refused by name, never run wrongly."""
    m, par = cfg.model, cfg.parallel
    check(par.tensor_grid == "1d", "parallel.tensor_grid", "mixture of experts runs on the 1d tensor layout only")
