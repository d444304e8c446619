"""Matrix-multiply FLOPs a compiled program executes (`executed_dot_flops`, counted through loop
trip counts and weighted by named scopes), and XLA's own `cost_analysis` (`flops_report`)."""

import math
import re

from mtjax.hlo_report.parse import _call_edges, _ints, _multiplicities, array_shapes, parse_program


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
    """The outermost (leftmost) component of an op_name path that is one of `scopes`, else None;
    or 'OUTER/INNER' where that is one of `scopes` too and INNER a later component (a scope within
    a scope, weighted on its own: the embedding inside a pipeline tick's forward).

    Transform wrappers are seen through: in 'jit(f)/transpose(jvp(pipeline_backward))/...' the
    component is 'pipeline_backward'. Outermost wins because a backward replays forward code:
    '.../pipeline_backward/.../pipeline_forward/dot_general' is backward work.
    """
    outer = None
    for part in op_name.split("/"):
        name = _TRANSFORM_RE.sub("", part)
        if outer is None:
            outer = name if name in scopes else None
        elif f"{outer}/{name}" in scopes:
            return f"{outer}/{name}"
    return outer


def _computation_scopes(parsed: dict, scopes) -> dict:
    """{computation: the one scope of `scopes` that its instructions' op_names name}, inherited
    by called computations that name none. XLA gives some dots it creates (a transposed or
    merged product) no op_name of their own; they belong to the scope of the branch around them.
    The entry computation (called by none) has none: it is the whole step, and a scope inlined in
    it (a pipeline's last tick after the loop) is not around the rest, its tick loop included."""
    caller = {}
    for comp, instrs in parsed.items():
        for instr in instrs:
            for callee, _, _ in _call_edges(instr, [], comp):
                caller.setdefault(callee, comp)
    own = {}
    for comp, instrs in parsed.items():
        found = {scope_of(m.group(1), scopes) for i in instrs for m in [_OP_NAME_RE.search(i["raw"])] if m}
        found.discard(None)
        if len(found) == 1 and comp in caller:
            own[comp] = found.pop()

    def scope(comp):
        for _ in range(len(parsed)):   # a bound on the depth of the (acyclic) call graph
            if comp in own:
                return own[comp]
            if comp not in caller:
                return None
            comp = caller[comp]
        return None
    return {c: scope(c) for c in parsed}


def branch_flops(program) -> dict:
    """{(computation, conditional's name): [matmul FLOPs of one execution of each branch, loops
    and calls inside it included]} for every reachable conditional of `program` (a parse.Program).
    Ranks of an SPMD program that take different branches execute the same FLOPs when a
    conditional's branches are equal."""
    parsed, memo = program.parsed, {}

    def cost(comp):
        if comp not in memo:
            instrs = parsed.get(comp, [])
            shapes = {i["name"]: i["shape"] for i in instrs}
            memo[comp] = sum(_matmul_flops(i, shapes) for i in instrs if _is_matmul(i)) + sum(
                factor * cost(callee) for i in instrs for callee, factor, _ in _call_edges(i, [], comp))
        return memo[comp]
    return {(comp, i["name"]): [cost(b) for b, _, _ in _call_edges(i, [], comp)]
            for comp, instrs in parsed.items() if program.mult[comp] for i in instrs if i["opcode"] == "conditional"}


def equal_branches_once(program):
    """`program` (a parse.Program) with each conditional whose branches all execute the same
    nonzero matmul FLOPs (`branch_flops`) counted as ONE branch: every branch (and what it calls)
    1/n of the conditional's executions, no longer `in_cond`. Which branch a device takes is
    unknown, but here it does not matter: the ring attention's (`lax.cond` between `_earlier` and
    `_later`, two L x L blocks either way) is the case. Branches of unequal cost (a pipeline's
    idle, forward and backward ticks) still count as if taken."""
    shares = {}
    for (comp, name), costs in branch_flops(program).items():
        if len(set(costs)) == 1 and costs[0] > 0:
            instr = next(i for i in program.parsed[comp] if i["name"] == name)
            shares.update({b: 1 / len(costs) for b, _, _ in _call_edges(instr, [], comp)})
    mult, in_cond, _ = _multiplicities(program.parsed, program.entry, shares)
    return program._replace(mult=mult, in_cond=in_cond)


def executed_dot_flops(hlo_text: str, scope_weights: dict | None = None) -> dict:
    """Matrix-multiply FLOPs one execution of the compiled program performs.

      flops = sum over dot / convolution ops (and XLA:GPU's cuBLAS calls, its rewritten dots) of
              matmul_flops(op) * multiplicity(its computation) * weight(op)

    with `multiplicity` as in `collective_report` (while bodies times their known trip count;
    fusions, calls and conditional branches once per execution of their caller) and
    weight(op) = scope_weights[s] for the outermost scope s of `scope_weights` in the op's
    op_name metadata (see `scope_of`), 1 if none. A conditional branch executes at most once
    per execution of its parent, but which one is unknown: when all its branches execute the
    same matmul FLOPs (the ring attention's), one branch counts (`equal_branches_once`);
    otherwise unweighted branch ops count as if taken, so the total is then an upper bound
    (`conditionals_upper_bound`). A caller that knows
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
    parsed, _, mult, in_cond, unknown = equal_branches_once(parse_program(hlo_text))
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
