"""What XLA fused in a compiled program (`fusion_report`), and the copies it inserted
(`copy_report`)."""

import re

from mtjax.hlo_report.parse import _NAME, _TRIP_RE, FUSION_OPS, _call_edges, array_bytes, parse_program

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
            if op in FUSION_OPS:
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
    `pipeline.stash.Stash`), or to give two outputs one value (zeros)."""
    program = parse_program(hlo_text)
    parsed, mult, in_cond, fused = program.parsed, program.mult, program.in_cond, program.fused()
    copies = []
    for comp, instrs in parsed.items():
        if mult[comp] == 0 or comp in fused:
            continue
        for instr in instrs:
            if instr["opcode"] == "copy":
                size = array_bytes(instr["shape"])
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
    program = parse_program(hlo_text)
    parsed, mult = program.parsed, program.mult
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
    fused = program.fused()
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
