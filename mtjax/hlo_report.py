"""What a compiled XLA program communicates, and what memory and FLOPs it uses.

`collective_report` reads post-optimization HLO text (`compiled.as_text()`)
and counts every collective exactly:

  count(op) = multiplicity(computation holding op)
  multiplicity(ENTRY) = 1
  multiplicity(callee) = sum over call sites of multiplicity(caller) * k,
      k = n for a while body and n + 1 for its condition (n = known trip
      count; the condition runs once more than the body to exit), 1 for
      fusions / calls / async wrappers / conditional branches.

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

`executed_dot_flops` counts, with the same multiplicities, the matrix-multiply
FLOPs of every `dot` and `convolution` the program executes (see there).
"""

import math
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

# Bits per element of each HLO primitive type; sub-byte types pack.
_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "token": 0,
}
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_TRIP_RE = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_QUOTED_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_NAME = r"%?([\w.\-]+)"


def _dtype_bits(dtype: str) -> int:
    """Bits per element; fp8 variants (f8e4m3fn, f8e5m2, ...) are 8."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    raise ValueError(f"unknown HLO element type {dtype!r}")


def array_shapes(shape_text: str) -> list:
    """[(dtype, dims)] of every array in an HLO shape, tuples flattened.

    'f32[8,4]{1,0}' -> [('f32', (8, 4))]; '(bf16[2]{0}, s32[])' ->
    [('bf16', (2,)), ('s32', ())]. Dynamic dims '<=8' count at their bound.
    """
    out = []
    for dtype, dims in _ARRAY_RE.findall(shape_text):
        sizes = tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        out.append((dtype, sizes))
    return out


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth = 0
    for i in range(start, len(text)):
        if text[i] in pairs:
            depth += 1
        elif text[i] in pairs.values():
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in {text!r}")


def _split_computations(hlo_text: str):
    """({computation name: [instruction lines]}, entry name)."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = _HEADER_RE.match(line)
        if header and not line[:1].isspace():
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and line.strip():
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in HLO text")
    return comps, entry


def _parse_instruction(line: str):
    """{name, shape, opcode, operands, attrs, raw} of one HLO instruction line."""
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    name, rest = m.group(1), m.group(2)
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    # Strip quoted strings (metadata, backend_config) so that attribute
    # regexes cannot match text such as op_name="while/body=...".
    attrs = _QUOTED_RE.sub('""', rest[close:])
    return {"name": name, "shape": shape, "opcode": op.group(1),
            "operands": rest[op.end():close - 1], "attrs": attrs, "raw": line}


def _names(attr_value: str) -> list:
    return [n.strip().lstrip("%") for n in attr_value.split(",") if n.strip()]


def _call_edges(instr: dict, unknown: list, computation: str) -> list:
    """[(callee, factor, via_conditional)] for the computations an instruction runs.

    Reducers (`to_apply=` of collectives, reduce, sort, ...) are not followed:
    they run per element inside the op and hold no collectives.
    """
    op, attrs = instr["opcode"], instr["attrs"]
    if op.endswith("-done") or op.endswith("-update") or _is_collective(op):
        # A -start already accounted for its wrapped computation, and a
        # collective's own `calls=` (async sugar) wraps that same collective.
        return []
    if op == "while":
        trip = _TRIP_RE.search(instr["raw"])
        if trip is None:
            unknown.append({"computation": computation, "while": instr["name"]})
        n = int(trip.group(1)) if trip else 1
        body = re.search(r"\bbody=" + _NAME, attrs).group(1)
        cond = re.search(r"\bcondition=" + _NAME, attrs).group(1)
        return [(body, n, False), (cond, n + 1 if trip else 1, False)]
    if op == "conditional":
        branches = re.search(r"\bbranch_computations=\{([^}]*)\}", attrs)
        names = _names(branches.group(1)) if branches else [
            m.group(1) for m in re.finditer(r"\b(?:true|false)_computation=" + _NAME, attrs)]
        return [(b, 1, True) for b in names]
    if op == "call":
        return [(re.search(r"\bto_apply=" + _NAME, attrs).group(1), 1, False)]
    edges = []
    for m in re.finditer(r"\b(?:calls|called_computations)=(\{[^}]*\}|%?[\w.\-]+)", attrs):
        edges += [(c, 1, False) for c in _names(m.group(1).strip("{}"))]
    return edges


def _multiplicities(parsed: dict, entry: str):
    """Executions per computation, whether reached via a conditional, unknown loops."""
    unknown, edges = [], {}
    for comp, instrs in parsed.items():
        edges[comp] = [e for i in instrs for e in _call_edges(i, unknown, comp)]
    order, seen = [], set()

    def visit(c):  # post-order DFS; HLO call graphs are acyclic
        seen.add(c)
        for callee, _, _ in edges.get(c, []):
            if callee not in seen:
                visit(callee)
        order.append(c)

    visit(entry)
    mult, in_cond = {c: 0 for c in parsed}, {c: False for c in parsed}
    mult[entry] = 1
    for c in reversed(order):  # callers before callees
        for callee, factor, cond in edges.get(c, []):
            mult[callee] += mult[c] * factor
            in_cond[callee] = in_cond[callee] or in_cond[c] or cond
    reachable = set(order)
    unknown = [u for u in unknown if u["computation"] in reachable]
    return mult, in_cond, unknown


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


def _ints(text: str) -> list:
    return [int(t) for t in text.split(",") if t.strip()]


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


def _is_collective(opcode: str) -> bool:
    return opcode in KINDS or (opcode.endswith("-start") and opcode.removesuffix("-start") in KINDS)


def collective_report(hlo_text: str, mesh) -> dict:
    """Every collective in the HLO, with executions counted through loops and calls.

    Returns {'by_kind': {kind: {'count', 'bytes'}}, 'by_axes': {'a,b': {kind:
    {'count', 'bytes'}}} ('' for trivial groups), 'ops': [{kind, name, axes,
    dtype, shapes, elements, bytes, group_size, multiplicity, computation,
    in_conditional}], 'unknown_trip_counts': [{computation, while}]}.
    Counts and bytes in by_kind / by_axes include multiplicity; an op's
    `elements` / `bytes` are per execution. Ops under a conditional count every
    branch, so their totals are upper bounds. Loops without a known trip count
    are counted once.
    """
    comps, entry = _split_computations(hlo_text)
    parsed = {c: [i for i in map(_parse_instruction, lines) if i] for c, lines in comps.items()}
    mult, in_cond, unknown = _multiplicities(parsed, entry)
    ops = []
    for comp, instrs in parsed.items():
        if mult[comp] == 0:
            continue  # unreachable, or only a reducer of some op
        done = _done_shapes(instrs)
        for instr in instrs:
            if _is_collective(instr["opcode"]):
                op = _collective(instr, done, mesh)
                ops.append(op | {"multiplicity": mult[comp], "computation": comp,
                                 "in_conditional": in_cond[comp]})
    by_kind, by_axes = {}, {}
    for op in ops:
        for table in (by_kind, by_axes.setdefault(",".join(op["axes"]), {})):
            entry_ = table.setdefault(op["kind"], {"count": 0, "bytes": 0})
            entry_["count"] += op["multiplicity"]
            entry_["bytes"] += op["multiplicity"] * op["bytes"]
    return {"by_kind": by_kind, "by_axes": by_axes, "ops": ops, "unknown_trip_counts": unknown}


def select(report: dict, kind=None, axes=None, min_elements=None) -> list:
    """Ops of a collective_report matching every given filter (axes: a tuple of names)."""
    return [op for op in report["ops"]
            if (kind is None or op["kind"] == kind)
            and (axes is None or tuple(op["axes"]) == tuple(axes))
            and (min_elements is None or op["elements"] >= min_elements)]


def _operand_shapes(instr: dict, shapes: dict) -> list:
    """[dims] of each operand. Compiled HLO names operands only ('%a, %b'), so their shapes come
    from `shapes` ({instruction name: shape text} of the same computation); text that prints them
    ('f32[4,8]{1,0} %a, ...') is read directly."""
    out, depth, start, text = [], 0, 0, instr["operands"] + ","
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            operand = text[start:i].strip()
            start = i + 1
            arrays = array_shapes(operand) or array_shapes(shapes[operand.split()[-1].lstrip("%")])
            out.append(arrays[0][1])
    return out


def _dims_attr(attrs: str, key: str) -> list:
    """The integers of `key={...}`, e.g. lhs_contracting_dims={1,2} -> [1, 2]; [] if absent."""
    m = re.search(r"\b" + key + r"=\{([\d,]*)\}", attrs)
    return _ints(m.group(1)) if m else []


def _matmul_flops(instr: dict, shapes: dict) -> int:
    """FLOPs of one execution of a dot, cuBLAS gemm or convolution (a multiply-add counts 2).

    dot: 2 * prod(result dims) * prod(lhs contracting dims); batch dims are in the result.
    convolution: 2 * prod(result dims) * prod(kernel dims) / kernel output features, i.e. each
    output element takes the whole window over its input-feature group (padding included).
    """
    out = array_shapes(instr["shape"])[0][1]    # a cuBLAS call's result comes before its workspace
    operands = _operand_shapes(instr, shapes)
    if instr["opcode"] in ("dot", "custom-call"):
        if instr["opcode"] == "dot":
            contracting = _dims_attr(instr["attrs"], "lhs_contracting_dims")
        else:   # XLA:GPU's rewritten dot keeps its dimension numbers in the backend config
            contracting = _ints(re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr["raw"])
                                .group(1).replace('"', ""))
        return 2 * math.prod(out) * math.prod(operands[0][d] for d in contracting)
    kernel = operands[1]
    kernel_labels = re.search(r"\bdim_labels=\w+_(\w+)->", instr["attrs"]).group(1)
    return 2 * math.prod(out) * math.prod(kernel) // kernel[kernel_labels.index("o")]


_MATMUL_OPS = ("dot", "convolution")
_CUBLAS_RE = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')   # XLA:GPU's dots


def _is_matmul(instr: dict) -> bool:
    return instr["opcode"] in _MATMUL_OPS or (instr["opcode"] == "custom-call"
                                              and _CUBLAS_RE.search(instr["raw"]) is not None)
_OP_NAME_RE = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')
_TRANSFORM_RE = re.compile(r"^(?:[\w\-]+\()+|\)+$")   # 'transpose(jvp(NAME))' -> 'NAME'


def _op_names(parsed: dict, wanted) -> dict:
    """{(computation, instruction name): op_name of its metadata} for the instructions that
    `wanted(instr)` selects. One without metadata inherits the op_name of the nearest instruction calling its
    computation (a fusion's, say): the caller's name stack is a prefix of what its own would be."""
    caller = {}
    for comp, instrs in parsed.items():
        for instr in instrs:
            for callee, _, _ in _call_edges(instr, [], comp):
                caller.setdefault(callee, (comp, instr))

    def op_name(comp, instr):
        for _ in range(len(parsed)):   # a bound on the depth of the call graph (it is acyclic)
            m = _OP_NAME_RE.search(instr["raw"])
            if m:
                return m.group(1)
            if comp not in caller:
                break
            comp, instr = caller[comp]
        return ""

    return {(c, i["name"]): op_name(c, i) for c, instrs in parsed.items() for i in instrs if wanted(i)}


def scope_of(op_name: str, scopes) -> str | None:
    """The outermost (leftmost) component of an op_name path that is one of `scopes`, else None.

    Transform wrappers are seen through: in 'jit(f)/transpose(jvp(pipeline_backward))/...' the
    component is 'pipeline_backward'. Outermost wins because a backward replays forward code:
    '.../pipeline_backward/.../pipeline_forward/dot_general' is backward work.
    """
    for part in op_name.split("/"):
        name = _TRANSFORM_RE.sub("", part)
        if name in scopes:
            return name
    return None


def _computation_scopes(parsed: dict, scopes) -> dict:
    """{computation: the one scope of `scopes` that its instructions' op_names name}, inherited
    by called computations that name none. XLA gives some dots it creates (a transposed or
    merged product) no op_name of their own; they belong to the scope of the branch around them."""
    own = {}
    for comp, instrs in parsed.items():
        found = {scope_of(m.group(1), scopes) for i in instrs for m in [_OP_NAME_RE.search(i["raw"])] if m}
        found.discard(None)
        if len(found) == 1:
            own[comp] = found.pop()
    caller = {}
    for comp, instrs in parsed.items():
        for instr in instrs:
            for callee, _, _ in _call_edges(instr, [], comp):
                caller.setdefault(callee, comp)

    def scope(comp):
        for _ in range(len(parsed)):   # a bound on the depth of the (acyclic) call graph
            if comp in own:
                return own[comp]
            if comp not in caller:
                return None
            comp = caller[comp]
        return None
    return {c: scope(c) for c in parsed}


def executed_dot_flops(hlo_text: str, scope_weights: dict | None = None) -> dict:
    """Matrix-multiply FLOPs one execution of the compiled program performs.

      flops = sum over dot / convolution ops (and XLA:GPU's cuBLAS calls, its rewritten dots) of
              matmul_flops(op) * multiplicity(its computation) * weight(op)

    with `multiplicity` as in `collective_report` (while bodies times their known trip count;
    fusions, calls and conditional branches once per execution of their caller) and
    weight(op) = scope_weights[s] for the outermost scope s of `scope_weights` in the op's
    op_name metadata (see `scope_of`), 1 if none. A conditional branch executes at most once
    per execution of its parent, but which one is unknown: unweighted branch ops count as if
    taken, so the total is then an upper bound (`conditionals_upper_bound`). A caller that knows
    the fraction of loop iterations taking a branch (taken ticks / ticks of a pipeline's tick
    loop) names the branch's work with `jax.named_scope` and passes that fraction here.
    Only what the compiler left as a matmul counts: a product it hoisted out of a loop counts
    once, one it rewrote as elementwise work (a matrix-vector product, say) not at all.

    Returns {'flops', 'by_scope': {scope: flops} (every given scope), 'unscoped_flops',
    'conditionals_upper_bound', 'unknown_trip_counts' (loops counted once), 'ops': [{name,
    opcode, computation, op_name, flops (per execution), multiplicity, scope, weight,
    in_conditional}]}.
    """
    weights = scope_weights or {}
    comps, entry = _split_computations(hlo_text)
    parsed = {c: [i for i in map(_parse_instruction, lines) if i] for c, lines in comps.items()}
    mult, in_cond, unknown = _multiplicities(parsed, entry)
    op_names = _op_names(parsed, _is_matmul)
    inherited = _computation_scopes(parsed, weights)
    ops = []
    for comp, instrs in parsed.items():
        if mult[comp] == 0:
            continue  # unreachable, or a reducer
        shapes = {i["name"]: i["shape"] for i in instrs}
        for instr in filter(_is_matmul, instrs):
            op_name = op_names[comp, instr["name"]]
            scope = scope_of(op_name, weights) or inherited.get(comp)
            ops.append({"name": instr["name"], "opcode": instr["opcode"], "computation": comp,
                        "op_name": op_name, "flops": _matmul_flops(instr, shapes),
                        "multiplicity": mult[comp], "scope": scope, "weight": weights.get(scope, 1.0),
                        "in_conditional": in_cond[comp]})

    def executed(scope):
        return sum(o["flops"] * o["multiplicity"] * o["weight"] for o in ops if o["scope"] == scope)

    by_scope = {s: executed(s) for s in weights}
    unscoped = executed(None)
    return {"flops": unscoped + sum(by_scope.values()), "by_scope": by_scope, "unscoped_flops": unscoped,
            "conditionals_upper_bound": any(o["in_conditional"] and o["scope"] is None and o["flops"] > 0
                                            for o in ops),
            "unknown_trip_counts": unknown, "ops": ops}


def memory_report(compiled) -> dict:
    """Byte sizes from `compiled.memory_analysis()`, per device.

    peak_estimate_bytes = argument + output + temp - alias is an ESTIMATE:
    XLA does not report the true high-water mark; aliased (donated) buffers
    are counted once. All values are None if the backend gives no analysis.
    """
    stats = compiled.memory_analysis()
    fields = {"argument_bytes": "argument_size_in_bytes", "output_bytes": "output_size_in_bytes",
              "temp_bytes": "temp_size_in_bytes", "alias_bytes": "alias_size_in_bytes",
              "generated_code_bytes": "generated_code_size_in_bytes"}
    fields["host_temp_bytes"] = "host_temp_size_in_bytes"   # pinned host memory (activation offload)
    out = {k: (None if stats is None else int(getattr(stats, v, 0))) for k, v in fields.items()}
    out["peak_estimate_bytes"] = None if stats is None else (
        out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"])
    return out


def flops_report(compiled) -> dict:
    """{'flops', 'bytes_accessed'} from `compiled.cost_analysis()`, per device.

    XLA's cost analysis counts a while-loop body ONCE, whatever its trip count,
    so a scanned model under-reports by the number of loop iterations. Older
    jax returns a list of per-program dicts (summed here); None if unavailable;
    a missing key means XLA counted nothing of that kind (0.0).
    """
    cost = compiled.cost_analysis()
    if cost is None:
        return {"flops": None, "bytes_accessed": None}
    costs = cost if isinstance(cost, (list, tuple)) else [cost]
    costs = [c for c in costs if c]
    return {"flops": float(sum(c.get("flops", 0.0) for c in costs)),
            "bytes_accessed": float(sum(c.get("bytes accessed", 0.0) for c in costs))}


def partitioned_hlo(lowered) -> str:
    """The HLO text right after SPMD partitioning (before the backend's own passes), from
    compiling `lowered` (a jax.stages.Lowered) with XLA's pass dump switched on for that pass.

    What the partitioner decided to send, before the backend rewrites it: XLA:CPU, for one,
    widens 16-bit collectives to f32 afterwards (it has no bf16 all-gather), so on CPU this is
    where a 16-bit all-gather can be seen.
    """
    import glob
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        lowered.compile(compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        found = sorted(glob.glob(f"{tmp}/*after_spmd-partitioning*.txt"))
        if not found:
            raise RuntimeError("XLA wrote no dump after spmd-partitioning: a single-device program has "
                               "none, and a compilation-cache hit compiles nothing")
        with open(found[-1]) as f:
            return f.read()


def compiled_report(compiled, mesh) -> dict:
    """{'flops': flops_report, 'memory': memory_report, 'collectives': collective_report,
    'fusion': fusion_report, 'copies': copy_report}."""
    text = compiled.as_text()
    return {"flops": flops_report(compiled), "memory": memory_report(compiled),
            "collectives": collective_report(text, mesh), "fusion": fusion_report(text),
            "copies": copy_report(text)}


# Fusion ---------------------------------------------------------------------------------------
# Elementwise HLO opcodes: outside a fusion each one reads and writes its whole operands in memory.
ELEMENTWISE = frozenset((
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "complex", "convert", "cosine",
    "divide", "erf", "exponential", "exponential-minus-one", "floor", "imag", "is-finite", "log",
    "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate", "not", "or", "popcnt",
    "power", "real", "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt", "select",
    "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt", "subtract",
    "tan", "tanh", "xor"))
_KIND_RE = re.compile(r"\bkind=(k\w+)")


def _ops_of(parsed: dict, root: str) -> dict:
    """{'fusions': {kind: n}, 'unfused_elementwise': {opcode: n}, 'nested_loops'} of the instructions that run
    in `root` and the computations it calls (calls, conditional branches, async wrappers), each
    counted once; not inside fusions (their bodies are fused) nor inside nested loops."""
    fusions, unfused, seen, todo, loops = {}, {}, set(), [root], 0
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in parsed:
            continue
        seen.add(comp)
        for instr in parsed[comp]:
            op = instr["opcode"]
            if op == "fusion":
                kind = _KIND_RE.search(instr["attrs"])
                kind = kind.group(1) if kind else "unknown"
                fusions[kind] = fusions.get(kind, 0) + 1
                continue
            if op in ELEMENTWISE:
                unfused[op] = unfused.get(op, 0) + 1
            if op == "while":
                loops += 1
                continue                       # a nested loop is reported on its own
            todo += [c for c, _, _ in _call_edges(instr, [], comp)]
    return {"fusions": dict(sorted(fusions.items())), "fusion_count": sum(fusions.values()),
            "unfused_elementwise": dict(sorted(unfused.items())),
            "unfused_elementwise_count": sum(unfused.values()), "nested_loops": loops}


def copy_report(hlo_text: str) -> dict:
    """The copies XLA inserted into a compiled program (`copy` ops outside fusions), in bytes
    of their outputs times the executions of their computation: {'bytes_per_step': those that
    run on every execution of their loop, 'conditional_bytes_per_step': those inside a
    conditional branch, as if the branch ran every time (an upper bound), 'largest':
    [(bytes, executions, instruction, in a branch)] the five largest}. XLA copies where a buffer
    cannot be updated in place, e.g. a loop carry that a branch passes through (see
    `pipeline.executor.Stash`), or to give two outputs one value (zeros)."""
    comps, entry = _split_computations(hlo_text)
    parsed = {c: [i for i in map(_parse_instruction, lines) if i] for c, lines in comps.items()}
    mult, in_cond, _ = _multiplicities(parsed, entry)
    fused = {c for instrs in parsed.values() for i in instrs if i["opcode"] == "fusion"
             for c, _, _ in _call_edges(i, [], "")}
    copies = []
    for comp, instrs in parsed.items():
        if mult[comp] == 0 or comp in fused:
            continue
        for instr in instrs:
            if instr["opcode"] == "copy":
                size = sum(math.prod(dims) * _dtype_bits(dt) // 8 for dt, dims in array_shapes(instr["shape"]))
                copies.append((size * mult[comp], mult[comp], instr["name"], in_cond[comp]))
    copies.sort(reverse=True)
    return {"bytes_per_step": sum(c[0] for c in copies if not c[3]),
            "conditional_bytes_per_step": sum(c[0] for c in copies if c[3]), "largest": copies[:5]}


def fusion_report(hlo_text: str) -> dict:
    """What XLA fused in a compiled (post-optimization) program.

    Returns {'program': counts over the whole program, every op counted once per execution
    (loop bodies times their trip count), 'loops': [{'body', 'parent' (the body of the loop it
    runs in, through calls; None at top level), 'trip_count', 'executions' (of the body, through
    enclosing loops), 'nested_loops' (while ops in the body, reported apart), and the body's
    counts, once}]}, where counts are
    {'fusions': {kind: n} (kLoop elementwise, kInput a reduction's input side, kOutput a matmul
    or reduction with its consumers, kCustom a backend kernel), 'fusion_count',
    'unfused_elementwise': {opcode: n} (elementwise ops left outside any fusion: each a full
    round trip through memory), 'unfused_elementwise_count'}. A scanned layer stack is one
    loop whose trip count is its layers: its body's counts are one layer's.
    """
    comps, entry = _split_computations(hlo_text)
    parsed = {c: [i for i in map(_parse_instruction, lines) if i] for c, lines in comps.items()}
    mult, _, _ = _multiplicities(parsed, entry)
    caller = {callee: comp for comp, instrs in parsed.items() for i in instrs
              for callee, _, _ in _call_edges(i, [], comp)}
    whiles = [(comp, instr) for comp, instrs in parsed.items() for instr in instrs
              if instr["opcode"] == "while" and mult[comp]]
    bodies = {re.search(r"\bbody=" + _NAME, instr["attrs"]).group(1) for _, instr in whiles}

    def enclosing_body(comp):
        while comp is not None and comp not in bodies:
            comp = caller.get(comp)
        return comp

    loops = []
    for comp, instr in whiles:
        body = re.search(r"\bbody=" + _NAME, instr["attrs"]).group(1)
        trip = _TRIP_RE.search(instr["raw"])
        loops.append({"body": body, "parent": enclosing_body(comp),
                      "trip_count": int(trip.group(1)) if trip else None,
                      "executions": mult[body], **_ops_of(parsed, body)})
    total_f, total_u = {}, {}
    fused = {c for instrs in parsed.values() for i in instrs if i["opcode"] == "fusion"
             for c, _, _ in _call_edges(i, [], "")}
    for comp, instrs in parsed.items():
        if mult[comp] == 0 or comp in fused:
            continue
        one = _ops_of({comp: instrs}, comp)
        for table, key in ((total_f, "fusions"), (total_u, "unfused_elementwise")):
            for k, n in one[key].items():
                table[k] = table.get(k, 0) + n * mult[comp]
    program = {"fusions": dict(sorted(total_f.items())), "fusion_count": sum(total_f.values()),
               "unfused_elementwise": dict(sorted(total_u.items())),
               "unfused_elementwise_count": sum(total_u.values())}
    return {"program": program, "loops": loops}
