"""`parallel.fsdp`, `parallel.fsdp_keep_gathered` and `parallel.fsdp_pipeline_gather` (ZeRO-3,
`mtjax/parallel/fsdp.py`).

fsdp shards the layer stack over the d c replica ranks, so at d c = 1 there is nothing to shard:
refused by the no-effect rule, as the distributed optimizer is (which fsdp implies). The 2d and
2.5d tensor grids run their own block (`model/grid_layers.py`) and are refused, and so is
`train.offload_activations` (its policy's host moves inside FSDP's own layer scan are untested).
`fsdp_pipeline_gather` chooses between two pipelined steps, so it needs fsdp and a pipeline; its
`step` gathers each stage's layers once for the whole step, where keeping the forward's gathered
layers for the backward (`fsdp_keep_gathered`) has nothing left to keep.
"""
from __future__ import annotations

from mtjax.config.schema import Config, ParallelConfig
from mtjax.config.validate.common import check, no_effect

PIPELINE_GATHERS = ("step", "microbatch")


def validate_fsdp(cfg: Config, d: int) -> None:
    par = cfg.parallel
    check(par.fsdp_pipeline_gather in PIPELINE_GATHERS, "parallel.fsdp_pipeline_gather",
          f"must be one of {', '.join(PIPELINE_GATHERS)}, got {par.fsdp_pipeline_gather!r}")
    no_effect(not par.fsdp_keep_gathered or par.fsdp, "parallel.fsdp_keep_gathered", "fsdp_keep_gathered = true",
              "parallel.fsdp=true")
    no_effect(par.fsdp_pipeline_gather == ParallelConfig.fsdp_pipeline_gather or (par.fsdp and par.pipe > 1),
              "parallel.fsdp_pipeline_gather", f"fsdp_pipeline_gather = {par.fsdp_pipeline_gather}",
              "parallel.fsdp=true and a pipeline (parallel.pipe > 1)")
    if not par.fsdp:
        return
    no_effect(d * par.context > 1, "parallel.fsdp", "fsdp = true", "data parallelism (parallel.data > 1) or "
              "context parallelism (parallel.context > 1) to shard the weights over")
    no_effect(not (par.fsdp_keep_gathered and par.pipe > 1 and par.fsdp_pipeline_gather == "step"),
              "parallel.fsdp_keep_gathered", "fsdp_keep_gathered = true under a pipeline",
              "parallel.fsdp_pipeline_gather=microbatch (step holds the stage's layers gathered for the whole step)")
    check(par.tensor_grid == "1d", "parallel.fsdp",
          f"fsdp is not implemented on tensor_grid={par.tensor_grid} (use the 1d tensor split)")
    check(not cfg.train.offload_activations, "parallel.fsdp",
          "fsdp does not combine with train.offload_activations (turn one off)")
