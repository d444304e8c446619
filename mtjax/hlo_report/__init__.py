"""What a compiled XLA program computes, communicates and stores, read from its optimized HLO.

One module per concern:
  parse.py        HLO text -> computations, instructions, shapes, executions per computation
  collectives.py  every collective: count and bytes per kind and per mesh axis
  flops.py        matmul FLOPs executed through loop trip counts; XLA's cost analysis
  memory.py       XLA's buffer assignment; the HLO right after SPMD partitioning
  fusions.py      what XLA fused, and the copies it inserted
  gpu_model.py    a per-kernel time model of a program compiled by XLA:GPU (`hardware.py`: its constants)
"""

from mtjax.hlo_report.collectives import (collective_report, group_axes, parse_mesh_groups,
                                          parse_replica_groups, select)
from mtjax.hlo_report.flops import branch_flops, equal_branches_once, executed_dot_flops, flops_report, scope_of
from mtjax.hlo_report.fusions import ELEMENTWISE, copy_report, fusion_report
from mtjax.hlo_report.memory import memory_report, partitioned_hlo
from mtjax.hlo_report.parse import KINDS, array_shapes

__all__ = ["KINDS", "ELEMENTWISE", "array_shapes", "collective_report", "group_axes", "parse_mesh_groups",
           "parse_replica_groups", "select", "branch_flops", "equal_branches_once", "executed_dot_flops",
           "flops_report", "scope_of", "copy_report", "fusion_report", "memory_report", "partitioned_hlo",
           "compiled_report"]


def compiled_report(compiled, mesh, rank_scope_weights: list | None = None) -> dict:
    """{'flops': flops_report, 'memory': memory_report, 'collectives': collective_report (its
    scoped ops weighted by `rank_scope_weights`), 'fusion': fusion_report, 'copies': copy_report}."""
    text = compiled.as_text()
    return {"flops": flops_report(compiled), "memory": memory_report(compiled),
            "collectives": collective_report(text, mesh, rank_scope_weights), "fusion": fusion_report(text),
            "copies": copy_report(text)}
