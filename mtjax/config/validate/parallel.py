"""The `parallel` group: the mesh against the devices, the batch split B = b m d, the tensor grid,
the pipeline schedule and its cap, and the no-effect rule for every layout field (`common`).

The schedule's facts come from the schedule tables (`mtjax.pipeline.schedules`), which stand
below config: plain numpy, no JAX, so a table is built here to see whether a cap can be met."""
from __future__ import annotations

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config, ParallelConfig
from mtjax.config.validate.common import (check, counted, devices_hint, divides, micro_batch_source, no_effect,
                                          positive, was_written)
from mtjax.parallel.grid_shape import GRIDS, grid_side
from mtjax.pipeline.schedules import SCHEDULES, SPLIT_SCHEDULES, make_schedule

PIPELINE = "pipeline parallelism (parallel.pipe > 1)"
CONTEXT_ATTENTION = ("all_gather", "ring")


def resolve_mesh_shape(cfg: Config, num_devices: int) -> tuple[int, int, int]:
    """(d, p, t) with data=-1 resolved against `num_devices` (the mesh is d x p x c x t, c =
    `parallel.context`); a mismatch names the devices needed."""
    par = cfg.parallel
    check(par.pipe >= 1, "parallel.pipe", f"must be >= 1, got {par.pipe}")
    check(par.context >= 1, "parallel.context", f"must be >= 1, got {par.context}")
    check(par.tensor >= 1, "parallel.tensor", f"must be >= 1, got {par.tensor}")
    check(par.data == -1 or par.data >= 1, "parallel.data", f"must be >= 1 or -1, got {par.data}")
    data, cell = par.data, par.pipe * par.context * par.tensor
    # the context axis is named in the product only where it is used (c > 1)
    names, sizes = ("pipe*context*tensor", f"{par.pipe}*{par.context}*{par.tensor}") if par.context > 1 else \
        ("pipe*tensor", f"{par.pipe}*{par.tensor}")
    if data == -1:
        needed = cell * max(1, -(-num_devices // cell))        # the next multiple of the cell
        check(num_devices % cell == 0, "parallel.data",
              f"-1 needs the {counted(num_devices, 'device')} to be a multiple of {names} = {cell} "
              f"({devices_hint(needed, cfg.distributed.num_processes)})")
        data = num_devices // cell
    size = data * cell
    check(size == num_devices, "parallel",
          f"mesh data*{names} = {data}*{sizes} = {size} differs from the {counted(num_devices, 'device')} "
          f"({devices_hint(size, cfg.distributed.num_processes)})")
    return data, par.pipe, par.tensor


def validate_context(cfg: Config, t: int) -> None:
    """`parallel.context` c and `context_attention`: each row is cut into 2c chunks (rank r holds
    chunks r and 2c - 1 - r), each chunk split t ways again under sequence parallelism."""
    par, m = cfg.parallel, cfg.model
    c = par.context
    check(par.context_attention in CONTEXT_ATTENTION, "parallel.context_attention",
          f"must be one of {', '.join(CONTEXT_ATTENTION)}, got {par.context_attention!r}")
    no_effect(par.context_attention == ParallelConfig.context_attention or c > 1, "parallel.context_attention",
              f"context_attention = {par.context_attention}", "context parallelism (parallel.context > 1)")
    if c == 1:
        return
    chunks = 2 * c * (t if par.sequence_parallel and t > 1 else 1)
    how = f"2*context*tensor = 2*{c}*{t}" if chunks != 2 * c else f"2*context = 2*{c}"
    divides(chunks, m.seq_len, "model.seq_len",
            f"seq_len {m.seq_len} is not divisible by {how} (context parallelism cuts each row into 2c "
            "load-balanced chunks" + (", each split over tensor by sequence parallelism)" if chunks != 2 * c else ")"))
    check(par.tensor_grid == "1d", "parallel.context",
          f"context parallelism is not implemented on tensor_grid={par.tensor_grid}: use the 1d tensor layout")


def batch_split(cfg: Config, d: int) -> tuple[int, int]:
    """(b, m) with B = b m d: from train.micro_batch, or from train.micro_batches when it is set.
    With m set, a written micro_batch (`common.was_written`: in the YAML files or the overrides,
    whatever its value) that disagrees with b = B/(m d) is refused: it would be ignored."""
    tr = cfg.train
    positive(cfg, ["train.global_batch", "train.micro_batch"])
    check(tr.micro_batches >= 0, "train.micro_batches", "must be >= 0")
    # a data size the user did not write (-1) is said where it came from
    took = "" if cfg.parallel.data != -1 else f" (data {d}: parallel.data=-1 takes the devices pipe, context and tensor leave)"
    if tr.micro_batches:
        divides(tr.micro_batches * d, tr.global_batch, "train.micro_batches",
                f"global_batch {tr.global_batch} is not divisible by micro_batches*data = {tr.micro_batches}*{d}{took}")
        b = tr.global_batch // (tr.micro_batches * d)
        check(tr.micro_batch == b or not was_written(cfg, "train.micro_batch"), "train.micro_batch",
              f"{tr.micro_batch} as written disagrees with train.micro_batches {tr.micro_batches}, which makes b = "
              f"global_batch/(micro_batches*data) = {tr.global_batch}/({tr.micro_batches}*{d}) = {b}{took}: set "
              f"train.micro_batch={b} (or leave it out), or leave train.micro_batches at 0")
        return b, tr.micro_batches
    divides(tr.micro_batch * d, tr.global_batch, "train.global_batch",
            f"global_batch {tr.global_batch} is not divisible by micro_batch*data = {tr.micro_batch}*{d}{took}"
            f"; {batch_fix(tr.global_batch, tr.micro_batch, d)} would fit")
    return tr.micro_batch, tr.global_batch // (tr.micro_batch * d)


def batch_fix(global_batch: int, micro_batch: int, d: int) -> str:
    """The nearest change that splits B = b m d: the largest micro-batch below b that B/d holds,
    else the next global batch that b d divides."""
    if global_batch % d == 0:
        b = max(x for x in range(1, micro_batch + 1) if (global_batch // d) % x == 0)
        return f"train.micro_batch={b}"
    return f"train.global_batch={-(-global_batch // (micro_batch * d)) * micro_batch * d}"


def validate_grid(cfg: Config, t: int) -> int:
    """`parallel.tensor_grid` and `tensor_depth` against t; -> the size heads, kv heads, h, f and V
    are split by: t for 1d, the grid side q for 2d / 2.5d."""
    par, m = cfg.parallel, cfg.model
    check(par.tensor_grid in GRIDS, "parallel.tensor_grid",
          f"must be one of {', '.join(GRIDS)}, got {par.tensor_grid!r}")
    check(par.tensor_depth >= 1, "parallel.tensor_depth", f"must be >= 1, got {par.tensor_depth}")
    no_effect(par.tensor_grid == "2.5d" or par.tensor_depth == 1, "parallel.tensor_depth",
              f"tensor_depth = {par.tensor_depth}", "parallel.tensor_grid=2.5d (only the 2.5d grid has a depth)")
    if par.tensor_grid == "1d":
        return t
    no_effect(t > 1, "parallel.tensor_grid", f"tensor_grid = {par.tensor_grid}", "parallel.tensor > 1")
    check(not par.tensor_overlap, "parallel.tensor_overlap",
          f"not implemented on tensor_grid={par.tensor_grid}: the collective matmuls are the 1d layout's")
    depth = par.tensor_depth if par.tensor_grid == "2.5d" else 1
    check(par.tensor_grid == "2d" or t % depth == 0, "parallel.tensor_depth",
          f"depth {depth} does not divide parallel.tensor {t}")
    q = grid_side(t, depth)
    shape = "a square q^2" if depth == 1 else f"q^2 * tensor_depth (q^2 * {depth})"
    check(q is not None, "parallel.tensor", f"tensor_grid={par.tensor_grid} needs {shape}, got {t}")
    divides(q, m.hidden_size, "model.hidden_size", f"hidden_size {m.hidden_size} is not divisible by the grid side {q}")
    divides(q, m.kv_heads, "model.num_kv_heads", f"num_kv_heads {m.kv_heads} is not divisible by the grid side {q}")
    check(not par.sequence_parallel, "parallel.sequence_parallel",
          f"tensor_grid={par.tensor_grid} splits the batch and h, not the sequence: turn it off")
    check(m.attention_dropout == 0, "model.attention_dropout",
          f"attention dropout is not implemented on tensor_grid={par.tensor_grid}")
    return q


def validate_grid_batch(cfg: Config, b: int, t: int) -> None:
    """The micro-batch splits into d q row blocks on a grid."""
    par = cfg.parallel
    if par.tensor_grid == "1d":
        return
    depth = par.tensor_depth if par.tensor_grid == "2.5d" else 1
    blocks = depth * grid_side(t, depth)
    key, source = micro_batch_source(cfg)
    divides(blocks, b, key, f"micro-batch {b}{source} is not divisible by the grid's batch blocks depth*q = {blocks}")


def _validate_half_batches(cfg: Config, b: int, p: int) -> None:
    """`parallel.half_batch_overlap` splits each micro-batch in two inside the training layer loop
    (`parallel/half_batches.py`): that loop's forms only."""
    par, tr = cfg.parallel, cfg.train
    if not par.half_batch_overlap or par.tensor == 1:
        return
    name = "parallel.half_batch_overlap"
    key, source = micro_batch_source(cfg)
    if par.half_batch_axis == "sequence":
        _validate_sequence_halves(cfg)
    else:
        check(b % 2 == 0, key, f"half_batch_overlap needs an even micro-batch to halve, got {b}{source} "
                               "(or halve the sequence: parallel.half_batch_axis=sequence)")
    check(par.schedule not in SPLIT_SCHEDULES or p == 1, name,
          f"not implemented with schedule={par.schedule} (its split backward): use 1f1b, gpipe or interleaved")
    check(not tr.offload_activations, name, "not implemented with train.offload_activations (turn one off)")
    check(par.tensor_grid == "1d", name, f"not implemented on tensor_grid={par.tensor_grid}")


def _validate_sequence_halves(cfg: Config) -> None:
    """`half_batch_axis=sequence`: each rank's rows split into the two halves of the positions
    (`block.halved`), the second half's attention reading the first's keys; what that needs."""
    par, key = cfg.parallel, "parallel.half_batch_axis"
    rows = 2 * par.tensor if par.sequence_parallel else 2
    divides(rows, cfg.model.seq_len, "model.seq_len", f"seq_len {cfg.model.seq_len} is not divisible by {rows}: "
            "half_batch_axis=sequence gives each " + ("tensor rank's rows" if par.sequence_parallel else "row") +
            " two equal halves")
    for ok, what in ((not cfg.model.moe, "a mixture of experts (model.num_experts > 0; its routing is per row)"),
                     (par.context == 1, "context parallelism (parallel.context > 1)"),
                     (not cfg.data.document_masking, "packed rows (data.document_masking)"),
                     (cfg.model.attention_dropout == 0, "attention dropout (model.attention_dropout > 0)")):
        check(ok, key, f"sequence is not implemented with {what}: use half_batch_axis=batch")


def _no_effect_in_layout(par: ParallelConfig, d: int, p: int, t: int) -> None:
    """The no-effect rule (`common`) for the layout fields the mesh (d, p, t) makes inert."""
    no_effect(par.max_in_flight == 0 or p > 1, "parallel.max_in_flight", f"max_in_flight = {par.max_in_flight}",
              PIPELINE)
    no_effect(par.virtual_stages == 1 or par.schedule == "interleaved", "parallel.virtual_stages",
              f"virtual_stages = {par.virtual_stages}", "parallel.schedule=interleaved")
    no_effect(par.virtual_stages == 1 or p > 1, "parallel.virtual_stages", f"virtual_stages = {par.virtual_stages}",
              PIPELINE)
    no_effect(par.schedule == ParallelConfig.schedule or p > 1, "parallel.schedule", f"schedule = {par.schedule}",
              PIPELINE)
    # interleaved at v = 1 builds 1F1B's table: the schedule asked for would change nothing. Named
    # for v (the field to raise), not with no_effect's "leave it at its default", which is the problem
    check(par.schedule != "interleaved" or par.virtual_stages >= 2 or p == 1, "parallel.virtual_stages",
          "1 with parallel.schedule=interleaved runs 1F1B's table (interleaving needs virtual_stages >= 2): "
          "here the schedule would have no effect; set virtual_stages >= 2, or parallel.schedule=1f1b")
    no_effect(not par.sequence_parallel or t > 1, "parallel.sequence_parallel", "sequence_parallel = true",
              "tensor parallelism (parallel.tensor > 1) to split the sequence over")
    no_effect(not par.tensor_overlap or t > 1, "parallel.tensor_overlap", "tensor_overlap = true",
              "tensor parallelism (parallel.tensor > 1), whose communication it overlaps")
    no_effect(not par.tensor_overlap or par.sequence_parallel, "parallel.tensor_overlap", "tensor_overlap = true",
              "sequence parallelism (parallel.sequence_parallel=true): it overlaps the sequence's all-gathers and "
              "reduce-scatters")
    no_effect(not par.half_batch_overlap or t > 1, "parallel.half_batch_overlap", "half_batch_overlap = true",
              "tensor parallelism (parallel.tensor > 1), whose communication it overlaps")
    no_effect(par.half_batch_group == ParallelConfig.half_batch_group or (par.half_batch_overlap and t > 1),
              "parallel.half_batch_group",
              f"half_batch_group = {par.half_batch_group}", "parallel.half_batch_overlap=true and parallel.tensor > 1")
    no_effect(par.half_batch_axis == ParallelConfig.half_batch_axis or (par.half_batch_overlap and t > 1),
              "parallel.half_batch_axis", f"half_batch_axis = {par.half_batch_axis}",
              "parallel.half_batch_overlap=true and parallel.tensor > 1")
    no_effect(not par.distributed_optimizer or d * par.context > 1, "parallel.distributed_optimizer",
              "distributed_optimizer = true", "data parallelism (parallel.data > 1) or context parallelism "
              "(parallel.context > 1) to split the optimizer state over")


def validate_parallel(cfg: Config, d: int, p: int, t: int) -> None:
    """The schedule, its cap and the micro-batches it needs; sequence parallelism's split of s."""
    par = cfg.parallel
    names = SCHEDULES + SPLIT_SCHEDULES
    check(par.schedule in names, "parallel.schedule", f"must be one of {', '.join(names)}, got {par.schedule!r}")
    check(par.max_in_flight >= 0, "parallel.max_in_flight",
          f"must be >= 0 (0 = the schedule's own), got {par.max_in_flight}")
    check(par.virtual_stages >= 1, "parallel.virtual_stages", "must be >= 1")
    check(par.half_batch_group >= 1, "parallel.half_batch_group", f"must be >= 1, got {par.half_batch_group}")
    check(par.half_batch_axis in ("batch", "sequence"), "parallel.half_batch_axis",
          f"must be batch or sequence, got {par.half_batch_axis!r}")
    _no_effect_in_layout(par, d, p, t)
    if par.sequence_parallel:
        divides(t, cfg.model.seq_len, "model.seq_len",
                f"seq_len {cfg.model.seq_len} is not divisible by parallel.tensor {t} (sequence parallelism)")
    b, micro_batches = batch_split(cfg, d)
    _validate_half_batches(cfg, b, p)
    # m is named where it was set: train.micro_batches, else the split of train.global_batch
    m_key = "train.micro_batches" if cfg.train.micro_batches else "train.global_batch"
    if p > 1:
        check(micro_batches >= p, m_key,
              f"{micro_batches} micro-batch{'es' * (micro_batches != 1)} per step, fewer than parallel.pipe {p}")
    if par.schedule == "interleaved" and p > 1:
        divides(p, micro_batches, m_key,
                f"interleaving needs micro-batches ({micro_batches}) to be a multiple of parallel.pipe {p}")
    if par.max_in_flight and micro_batches >= p:   # whether the schedule's order meets the cap (a table build)
        try:
            make_schedule(par.schedule, p, micro_batches, par.virtual_stages, par.max_in_flight)
        except ValueError as e:
            raise ConfigError("parallel.max_in_flight", str(e)) from None
