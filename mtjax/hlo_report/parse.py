"""Reading post-optimization HLO text: computations, instructions, shapes, and how often each
computation runs.

  multiplicity(ENTRY) = 1
  multiplicity(callee) = sum over call sites of multiplicity(caller) * k,
      k = n for a while body and n + 1 for its condition (n = known trip
      count; the condition runs once more than the body to exit), 1 for
      fusions / calls / async wrappers / conditional branches (each branch as if
      taken: an upper bound; `flops.equal_branches_once` counts a conditional whose
      branches cost the same as one branch).
"""

import functools
import math
import re
from typing import NamedTuple

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
# A fusion runs as one kernel. XLA:GPU in jax >= 0.11 also runs some fusions asynchronously
# (an in-place dynamic-update-slice of a scan's stacked outputs): `fusion-start` calls the fused
# computation and `fusion-done` only waits for it.
FUSION_OPS = frozenset(("fusion", "fusion-start"))


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


_BRACKET_RE = re.compile(r"[(){}\[\]]")


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start] (any of (), {}, [] nest)."""
    depth = 0
    for m in _BRACKET_RE.finditer(text, start):     # a regex scan: a loop over characters was most of a parse
        if m.group() in "({[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return m.end()
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


def _is_collective(opcode: str) -> bool:
    return opcode in KINDS or (opcode.endswith("-start") and opcode.removesuffix("-start") in KINDS)


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


def _multiplicities(parsed: dict, entry: str, shares: dict | None = None):
    """Executions per computation, whether reached via a conditional, unknown loops. `shares`
    ({branch computation: fraction}) counts those branches of conditionals that fraction of
    their conditional's executions, and not as reached via a conditional."""
    shares = shares or {}
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
            shared = cond and callee in shares
            mult[callee] += mult[c] * factor * (shares[callee] if shared else 1)
            in_cond[callee] = in_cond[callee] or in_cond[c] or (cond and not shared)
    reachable = set(order)
    unknown = [u for u in unknown if u["computation"] in reachable]
    return mult, in_cond, unknown



def _ints(text: str) -> list:
    return [int(t) for t in text.split(",") if t.strip()]


def array_bytes(shape_text: str) -> int:
    """Bytes of every array in an HLO shape (tuples summed; sub-byte types packed)."""
    return sum(math.prod(dims) * _dtype_bits(dtype) for dtype, dims in array_shapes(shape_text)) // 8


class Program(NamedTuple):
    """A parsed HLO module: {computation: [instruction dicts]}, its entry, executions per
    computation (`_multiplicities`), whether each is reached through a conditional branch, and
    the loops whose trip count is unknown (counted once)."""
    parsed: dict
    entry: str
    mult: dict
    in_cond: dict
    unknown: list

    def fused(self) -> set:
        """Computations that are fusion bodies (their instructions run inside one kernel)."""
        return {c for instrs in self.parsed.values() for i in instrs if i["opcode"] in FUSION_OPS
                for c, _, _ in _call_edges(i, [], "")}


@functools.lru_cache(maxsize=8)
def parse_program(hlo_text: str) -> Program:
    """The parsed program. Memoized on the text (the last 8): the analyses of one compiled program
    (`compiled_report`'s, `executed_dot_flops`, the GPU model) each start here, and parsing is most
    of their time. The Program is shared between them: read it, never modify it."""
    comps, entry = _split_computations(hlo_text)
    parsed = {c: [i for i in map(_parse_instruction, lines) if i] for c, lines in comps.items()}
    mult, in_cond, unknown = _multiplicities(parsed, entry)
    return Program(parsed, entry, mult, in_cond, unknown)
