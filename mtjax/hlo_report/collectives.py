"""What a compiled XLA program communicates: every collective, counted exactly.

`collective_report` reads post-optimization HLO text (`compiled.as_text()`); each op counts
`multiplicity` times (`parse.py`: loop bodies times their trip count).

`bytes(op)` is the size of the full tensor along the collective, i.e. the
tensor before scattering or after gathering:
  all-reduce, collective-permute, all-to-all: the operand (= result) size;
  all-gather: the result size; reduce-scatter: the operand size, which is the
  result size times the group size.

Replica-group ids are positions in the program's device assignment; for a
program compiled over `mesh` that is the order of `mesh.devices.flat`, so a
position p sits at mesh coordinates `np.unravel_index(p, mesh.devices.shape)`.
A collective's `axes` are the mesh axes along which members of a group differ.

Note: XLA:CPU promotes bf16 all-reduces to f32 before communicating, and the
report shows what is actually sent (f32 there), not the dtype in the source.
"""

import math
import re

import numpy as np

from mtjax.hlo_report.flops import _computation_scopes, _op_names, scope_of
from mtjax.hlo_report.parse import (_balanced, _dtype_bits, _ints, _is_collective, array_shapes,
                                    parse_program)


def parse_replica_groups(text: str) -> list:
    """Replica groups as lists of ids, from the text after `replica_groups=`.

    Explicit: '{{0,1},{2,3}}' -> [[0, 1], [2, 3]]; '{}' -> [] (one group of
    every device). Iota form '[G,S]<=[d0,d1,...]T(p0,p1,...)': take
    arange(prod(d)), reshape to d, transpose by p (identity if no T), reshape
    to [G, S]; row g is group g. E.g. '[2,4]<=[4,2]T(1,0)' -> [[0,2,4,6],[1,3,5,7]].
    """
    text = text.strip()
    iota = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        dims, reshape = _ints(iota.group(1)), _ints(iota.group(2))
        perm = _ints(iota.group(3)) if iota.group(3) else list(range(len(reshape)))
        ids = np.arange(math.prod(reshape)).reshape(reshape).transpose(perm)
        return ids.reshape(dims[0], -1).tolist()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"unrecognised replica groups {text!r}")
    return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]


def parse_mesh_groups(text: str) -> list:
    """Replica groups from XLA's mesh form, e.g.
    "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}".

    The device ids (an iota '[d..]T(p..)', or an explicit list, or absent
    for 0..n-1) are laid out on the named mesh; each group is the devices
    that differ only along the axes in braces.
    """
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", text.strip())
    if m is None:
        raise ValueError(f"unrecognised replica groups {text!r}")
    axes = [(n.strip().strip("'"), int(v)) for n, v in (a.split("=") for a in m.group(1).split(","))]
    sizes = [v for _, v in axes]
    ids = _device_ids(m.group(2), math.prod(sizes)).reshape(sizes)
    chosen = {a.strip().strip("'") for a in m.group(3).split(",") if a.strip()}
    inner = [i for i, (name, _) in enumerate(axes) if name in chosen]
    outer = [i for i in range(len(axes)) if i not in inner]
    grouped = ids.transpose(outer + inner).reshape(-1, math.prod(sizes[i] for i in inner) if inner else 1)
    return grouped.tolist()


def _device_ids(text, n: int):
    """Device ids of the mesh form: iota '[d0,d1]T(p0,p1)', an explicit list, or 0..n-1."""
    if not text:
        return np.arange(n)
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if iota:
        dims = _ints(iota.group(1))
        perm = _ints(iota.group(2)) if iota.group(2) else list(range(len(dims)))
        return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1)
    return np.asarray(_ints(text.strip("{}[] ")))


def _groups(attrs: str, num_devices: int) -> list:
    """Device groups of a collective; collective-permute's pairs count as groups."""
    m = re.search(r"\b(replica_groups|source_target_pairs)=", attrs)
    if m is None:
        return [list(range(num_devices))]
    start = m.end()
    if attrs.startswith("mesh[", start):  # mesh form: runs to the closing brace of its axis set
        return parse_mesh_groups(attrs[start:attrs.index("}", start) + 1]) or [list(range(num_devices))]
    end = _balanced(attrs, start)
    if attrs[start] == "[":  # iota form: '[G,S]<=[...]' plus an optional 'T(...)'
        tail = re.match(r"<=\[[\d,]+\](?:T\([\d,]+\))?", attrs[end:])
        end += tail.end()
    groups = parse_replica_groups(attrs[start:end])
    return groups or [list(range(num_devices))]


def group_axes(groups: list, mesh) -> tuple:
    """Mesh axis names (in mesh order) along which members of any group differ."""
    shape = mesh.devices.shape
    differ = set()
    for group in groups:
        if max(group) >= mesh.devices.size:
            raise ValueError(f"device position {max(group)} outside mesh of {mesh.devices.size}")
        coords = np.unravel_index(np.asarray(group), shape)
        differ |= {i for i, c in enumerate(coords) if len(set(c.tolist())) > 1}
    return tuple(name for i, name in enumerate(mesh.axis_names) if i in differ)


def _collective(instr: dict, done_shapes: dict, mesh) -> dict:
    """One report entry (without multiplicity) for a collective instruction."""
    kind = instr["opcode"].removesuffix("-start")
    # An async -start's own shape bundles operands and contexts; the matching
    # -done's shape is the collective's result.
    shape = done_shapes.get(instr["name"], instr["shape"])
    arrays = [a for a in array_shapes(shape) if a[0] != "token"]
    groups = _groups(instr["attrs"], mesh.devices.size)
    scale = len(groups[0]) if kind == "reduce-scatter" else 1  # result -> operand
    elements = sum(math.prod(d) for _, d in arrays) * scale
    bits = sum(math.prod(d) * _dtype_bits(t) for t, d in arrays) * scale
    dtypes = sorted({t for t, _ in arrays})
    return {"kind": kind, "name": instr["name"], "axes": group_axes(groups, mesh),
            "dtype": ",".join(dtypes),
            "shapes": [f"{t}[{','.join(map(str, d))}]" for t, d in arrays],
            "elements": elements, "bytes": bits // 8, "group_size": len(groups[0])}


def _done_shapes(instrs: list) -> dict:
    """{name of an async -start: result shape of its -done}."""
    out = {}
    for i in instrs:
        if i["opcode"].endswith("-done"):
            first = re.search(r"%([\w.\-]+)", i["operands"])
            out[first.group(1) if first else i["operands"].split()[-1]] = i["shape"]
    return out


def collective_report(hlo_text: str, mesh, rank_scope_weights: list | None = None) -> dict:
    """Every collective in the HLO, with executions counted through loops and calls.

    Returns {'by_kind': {kind: {'count', 'bytes'}}, 'by_axes': {'a,b': {kind:
    {'count', 'bytes'}}} ('' for trivial groups), 'ops': [{kind, name, axes,
    dtype, shapes, elements, bytes, group_size, multiplicity, computation,
    in_conditional, scope}], 'conditionals_upper_bound', 'unknown_trip_counts': [{computation, while}]}.
    Counts and bytes in by_kind / by_axes include multiplicity; an op's
    `elements` / `bytes` are per execution. Ops under a conditional count every
    branch, so their totals are upper bounds (`conditionals_upper_bound`), unless
    `rank_scope_weights` ([{named scope: share of its loop's iterations that run it}] per rank,
    as `flops.executed_dot_flops` takes one) weights them: an op under such a scope then counts
    its executions times the mean of the ranks' weights. Loops without a known trip count
    are counted once.
    """
    parsed, _, mult, in_cond, unknown = parse_program(hlo_text)
    scope_for = _scopes(parsed, rank_scope_weights)
    ops = []
    for comp, instrs in parsed.items():
        if mult[comp] == 0:
            continue  # unreachable, or only a reducer of some op
        done = _done_shapes(instrs)
        for instr in instrs:
            if _is_collective(instr["opcode"]):
                op = _collective(instr, done, mesh)
                scope, weight = scope_for(comp, instr["name"])
                ops.append(op | {"multiplicity": mult[comp] * weight, "computation": comp,
                                 "in_conditional": in_cond[comp], "scope": scope})
    by_kind, by_axes = {}, {}
    for op in ops:
        for table in (by_kind, by_axes.setdefault(",".join(op["axes"]), {})):
            entry_ = table.setdefault(op["kind"], {"count": 0, "bytes": 0})
            entry_["count"] += op["multiplicity"]
            entry_["bytes"] += op["multiplicity"] * op["bytes"]
    bound = any(op["in_conditional"] and op["scope"] is None for op in ops)
    return {"by_kind": by_kind, "by_axes": by_axes, "ops": ops, "conditionals_upper_bound": bound,
            "unknown_trip_counts": unknown}


def _scopes(parsed: dict, rank_scope_weights: list | None):
    """(computation, instruction) -> (its outermost weighted scope or None, the mean weight over
    the ranks: 1 outside every scope)."""
    if not rank_scope_weights or not any(rank_scope_weights):
        return lambda comp, name: (None, 1)
    scopes = {s for w in rank_scope_weights for s in w}
    names = _op_names(parsed, lambda i: _is_collective(i["opcode"]))
    inherited = _computation_scopes(parsed, scopes)

    def scope_for(comp, name):
        scope = scope_of(names[comp, name], scopes) or inherited.get(comp)
        if scope is None:
            return None, 1
        return scope, sum(w.get(scope, 0.0) for w in rank_scope_weights) / len(rank_scope_weights)
    return scope_for


def select(report: dict, kind=None, axes=None, min_elements=None) -> list:
    """Ops of a collective_report matching every given filter (axes: a tuple of names)."""
    return [op for op in report["ops"]
            if (kind is None or op["kind"] == kind)
            and (axes is None or tuple(op["axes"]) == tuple(axes))
            and (min_elements is None or op["elements"] >= min_elements)]

