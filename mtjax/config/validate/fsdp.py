"""`parallel.fsdp` and `parallel.fsdp_keep_gathered` (ZeRO-3, `mtjax/parallel/fsdp.py`).

fsdp shards the layer stack over the d c replica ranks, so at d c = 1 there is nothing to shard:
refused by the no-effect rule, as the distributed optimizer is (which fsdp implies). The 2d and
2.5d tensor grids run their own block (`model/grid_layers.py`) and are refused, and so is
`train.offload_activations` (its policy's host moves inside FSDP's own layer scan are untested).
"""
from __future__ import annotations

from mtjax.config.schema import Config
from mtjax.config.validate.common import check, no_effect


def validate_fsdp(cfg: Config, d: int) -> None:
    par = cfg.parallel
    no_effect(not par.fsdp_keep_gathered or par.fsdp, "parallel.fsdp_keep_gathered", "fsdp_keep_gathered = true",
              "parallel.fsdp=true")
    if not par.fsdp:
        return
    no_effect(d * par.context > 1, "parallel.fsdp", "fsdp = true", "data parallelism (parallel.data > 1) or "
              "context parallelism (parallel.context > 1) to shard the weights over")
    check(par.tensor_grid == "1d", "parallel.fsdp",
          f"fsdp is not implemented on tensor_grid={par.tensor_grid} (use the 1d tensor split)")
    check(not cfg.train.offload_activations, "parallel.fsdp",
          "fsdp does not combine with train.offload_activations (turn one off)")
