"""AdamW with the learning-rate schedule (`lr_schedule.py`: linear warm-up, then optim.decay_style),
global-norm clipping, no decay on norms and biases."""
from __future__ import annotations

import jax
import optax

from mtjax.config.schema import Config
from mtjax.training.lr_schedule import learning_rate

NO_DECAY = ("bias", "scale")   # LayerNorm/RMSNorm scales and every bias


def decay_mask(params):
    """True for parameters that get weight decay: everything but norms and biases."""
    def keep(path, _):
        return getattr(path[-1], "key", None) not in NO_DECAY
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    op = cfg.optim
    # both stages are stateless: the optimizer state has one structure whatever optim.clip_grad,
    # so a run resumes across a change of it (as Megatron's --clip-grad may change)
    clip = optax.clip_by_global_norm(op.clip_grad) if op.clip_grad > 0 else optax.identity()
    return optax.chain(clip, optax.adamw(learning_rate(cfg), b1=op.beta1, b2=op.beta2, eps=op.eps,
                                         weight_decay=op.weight_decay, mask=decay_mask))
