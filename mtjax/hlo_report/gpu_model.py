"""A per-kernel time model of a program compiled by XLA:GPU, read from its optimized HLO.

Every instruction of an executed, unfused computation that launches work is a kernel: a fusion
(a Triton or cuBLAS GEMM, a Triton normalisation, an elementwise or reduction kernel), a custom
call (cuBLAS, cuDNN attention), a copy, another unfused op, or a collective. Each runs
`multiplicity` times (loop bodies times their trip count, `parse.py`). For one execution

    t(kernel) = max(flops / F, bytes / BW, alu / ALU) + launch

  flops   matmul FLOPs (tensor cores) at F = the sustained GEMM rate, or the flash-attention
          rate for a cuDNN attention call;
  bytes   HBM traffic: each fused parameter read once (only the slice where a parameter is used
          by dynamic-slice or slice alone; nothing where it is the buffer a dynamic-update-slice
          writes into in place), and each output written once (only the update of an in-place
          dynamic-update-slice);
  alu     CUDA-core work: elements x issue cost of every elementwise op in the kernel (32-bit
          integer ops cost 2, transcendentals 8: a threefry dropout mask is ~100 integer ops an
          element), and a reduction's input elements x its reducer's ops.

A collective moves what each device sends in a ring (all-reduce 2(n-1)/n N, all-gather and
reduce-scatter (n-1)/n N, permute N) over NVLink within a node, the network across nodes. An
async collective is hidden by the kernels the schedule places between its start and its done;
what they do not cover is exposed. The step's time is

    step = sum of kernel times + exposed collective time + loop iterations x loop cost.

Equal-cost branches count once (`flops.equal_branches_once`), others as if taken (flagged). Constants: `hardware.py`.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

from mtjax.hlo_report.collectives import _groups
from mtjax.hlo_report.flops import _computation_scopes, _matmul_flops, _op_names, equal_branches_once, scope_of
from mtjax.hlo_report.fusions import ELEMENTWISE
from mtjax.hlo_report.hardware import GpuSpec
from mtjax.hlo_report.parse import (_NAME, _TRIP_RE, FUSION_OPS, _call_edges, _is_collective, array_bytes, array_shapes,
                                    parse_program)

# Instructions that launch nothing: buffers (`lax.empty`'s AllocateBuffer too), views and control
# flow (whose bodies are walked).
NO_KERNEL = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                       "conditional", "call", "after-all", "add-dependency", "opt-barrier", "domain",
                       "partition-id", "replica-id", "send-done", "recv-done", "copy-done",
                       "async-start", "async-update", "async-done"))   # an async wrapper's computation is walked
SPECIAL = frozenset(("exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh",
                     "erf", "rsqrt", "sqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2"))
_BACKEND_KIND_RE = re.compile(r'"fusion_backend_config":\s*\{\s*"kind":\s*"([^"]+)"')
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_SCORES_RE = re.compile(r'"intermediate_tensor_shape":\s*\{.*?"dimensions":\s*\[([^\]]*)\]')
_CAUSAL_RE = re.compile(r'"mask_type":\s*"CAUSAL"')


def _elements(shape_text: str) -> int:
    return sum(math.prod(dims) for _, dims in array_shapes(shape_text))


def _operand_names(instr: dict) -> list:
    return _OPERAND_RE.findall(instr["operands"])


class _Body:
    """A fused computation: its instructions by name and who uses each."""

    def __init__(self, instrs: list):
        self.instrs = instrs
        self.by_name = {i["name"]: i for i in instrs}
        self.users = defaultdict(list)
        for i in instrs:
            for k, name in enumerate(_operand_names(i)):
                self.users[name].append((i, k))
        self.root = next((i for i in instrs if i["raw"].lstrip().startswith("ROOT")), instrs[-1])

    def read_bytes(self, name: str) -> int:
        """Bytes of `name` that the kernel reads: the slices taken of it where slicing is its only
        use, nothing where it is only the buffer an in-place dynamic-update-slice writes."""
        full = array_bytes(self.by_name[name]["shape"])
        total = 0
        for user, k in self.users[name]:
            if user["opcode"] == "bitcast":
                total += self.read_bytes(user["name"])
            elif user["opcode"] in ("dynamic-slice", "slice", "gather") and k == 0:
                total += array_bytes(user["shape"])
            elif user["opcode"] == "dynamic-update-slice" and k == 0:
                continue
            else:
                return full
        return min(total, full)

    def written_bytes(self, instr: dict | None = None) -> int:
        """Bytes the kernel writes: its outputs, an in-place dynamic-update-slice's update only."""
        instr = instr or self.root
        if instr["opcode"] == "tuple":
            return sum(self.written_bytes(self.by_name[n]) for n in _operand_names(instr))
        if instr["opcode"] == "bitcast":
            return self.written_bytes(self.by_name[_operand_names(instr)[0]])
        if instr["opcode"] == "dynamic-update-slice":
            return array_bytes(self.by_name[_operand_names(instr)[1]]["shape"])
        return array_bytes(instr["shape"])

    def traffic(self) -> int:
        params = [i["name"] for i in self.instrs if i["opcode"] == "parameter"]
        return sum(self.read_bytes(p) for p in params) + self.written_bytes()


def _op_cost(instr: dict, spec: GpuSpec) -> float:
    """Issue cost of one element of an elementwise op, in fp32 instructions."""
    op, dtypes = instr["opcode"], [t for t, _ in array_shapes(instr["shape"])]
    if op in SPECIAL:
        return spec.special_op_cost
    if op != "compare" and dtypes and (dtypes[0][0] in "su"):   # s32, u32, s64, u8, ...
        return spec.int_op_cost * (2 if dtypes[0].endswith("64") else 1)
    return 1.0


def _alu_ops(parsed: dict, comp: str, spec: GpuSpec) -> float:
    """CUDA-core instructions of one run of a fused computation (nested fusions included)."""
    ops = 0.0
    for instr in parsed.get(comp, []):
        op = instr["opcode"]
        if op in ELEMENTWISE:
            ops += _op_cost(instr, spec) * _elements(instr["shape"])
        elif op in ("reduce", "reduce-window"):
            reducer = re.search(r"\bto_apply=" + _NAME, instr["attrs"]).group(1)
            per = max(1, sum(1 for i in parsed.get(reducer, []) if i["opcode"] in ELEMENTWISE))
            shapes = {i["name"]: i["shape"] for i in parsed[comp]}
            first = _operand_names(instr)[0]
            ops += per * _elements(shapes[first])
        elif op == "rng-bit-generator":        # Philox 4x32-10: about 15 integer ops per u32
            ops += 15 * spec.int_op_cost * _elements(instr["shape"])
        elif op in FUSION_OPS:
            ops += sum(_alu_ops(parsed, c, spec) for c, _, _ in _call_edges(instr, [], comp))
    return ops


def _dot_flops(parsed: dict, comp: str) -> int:
    """Matmul FLOPs of the dots in a fused computation (nested fusions included)."""
    shapes = {i["name"]: i["shape"] for i in parsed.get(comp, [])}
    flops = 0
    for instr in parsed.get(comp, []):
        if instr["opcode"] == "dot":
            flops += _matmul_flops(instr, shapes)
        elif instr["opcode"] in FUSION_OPS:
            flops += sum(_dot_flops(parsed, c) for c, _, _ in _call_edges(instr, [], comp))
    return flops


def _attention_flops(instr: dict, shapes: dict) -> float:
    """Executed FLOPs of a cuDNN fused attention call, from its score shape [b, a, s, s_kv] and the
    head dim d (the last of Q's): Q K^T and P V forward (2 matmuls of 2 b a s s_kv d FLOPs); the
    backward recomputes Q K^T and adds dV, dP, dQ and dK (5); half with a causal mask (cuDNN
    skips the masked blocks)."""
    raw = instr["raw"]
    scores = _SCORES_RE.search(raw)
    q = array_shapes(shapes[_operand_names(instr)[0]])[0][1]
    if scores is not None:
        elements = math.prod(int(x) for x in re.findall(r"\d+", scores.group(1)))
    else:   # no score shape in the config: self-attention, s the longest of Q's middle dims (s >= heads)
        elements = math.prod(q[:-1]) * max(q[1:-1])
    matmuls = 5 if "Backward" in _TARGET_RE.search(raw).group(1) else 2
    causal = 0.5 if _CAUSAL_RE.search(raw) else 1.0
    return 2 * matmuls * elements * q[-1] * causal


def _kernel(instr: dict, comp: str, program, spec: GpuSpec, shapes: dict) -> dict:
    """{kind, flops, bytes, alu, rate} of one execution of a kernel instruction."""
    op, parsed = instr["opcode"], program.parsed
    operands = [shapes[n] for n in _operand_names(instr) if n in shapes]
    plain_bytes = sum(map(array_bytes, operands)) + array_bytes(instr["shape"])
    if op in FUSION_OPS:
        body = next(c for c, _, _ in _call_edges(instr, [], comp))
        backend = _BACKEND_KIND_RE.search(instr["raw"])
        flops = _dot_flops(parsed, body)
        kind = "gemm" if flops else (backend or re.search(r"kind=(k\w+)", instr["attrs"])).group(1)
        return {"kind": kind, "flops": flops, "bytes": _Body(parsed[body]).traffic(),
                "alu": _alu_ops(parsed, body, spec), "rate": spec.matmul_flops}
    if op == "custom-call":
        target = _TARGET_RE.search(instr["raw"]).group(1)
        if target.startswith("__cublas"):
            out = array_bytes(instr["shape"].split("s8[")[0])       # the result, not the workspace
            return {"kind": "gemm", "flops": _matmul_flops(instr, shapes),
                    "bytes": sum(map(array_bytes, operands)) + out,
                    "alu": 0.0, "rate": spec.matmul_flops}
        if target.startswith("__cudnn$fmha"):
            return {"kind": "attention", "flops": _attention_flops(instr, shapes), "bytes": plain_bytes,
                    "alu": 0.0, "rate": spec.attention_flops}
        return {"kind": f"custom:{target}", "flops": 0, "bytes": plain_bytes, "alu": 0.0, "rate": spec.matmul_flops}
    if op == "copy":
        return {"kind": "copy", "flops": 0, "bytes": 2 * array_bytes(instr["shape"]), "alu": 0.0, "rate": 1.0}
    alu = _op_cost(instr, spec) * _elements(instr["shape"]) if op in ELEMENTWISE else 0.0
    return {"kind": f"op:{op}", "flops": 0, "bytes": plain_bytes, "alu": alu, "rate": 1.0}


def _collective_time(instr: dict, shapes: dict, spec: GpuSpec, num_devices: int) -> tuple[float, int]:
    """(seconds, bytes each device sends) of one collective, in a ring over its group."""
    kind = instr["opcode"].removesuffix("-start")
    groups = _groups(instr["attrs"], num_devices)
    n = max(1, len(groups[0]))
    payload = [shapes[x] for x in _operand_names(instr) if x in shapes]
    size = max(sum(map(array_bytes, payload)), 1)
    if kind == "all-gather":
        size = size * n
    ring = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
            "all-to-all": (n - 1) / n, "collective-permute": 1.0}[kind]
    sent = int(ring * size)
    across = any(len({d // spec.gpus_per_node for d in g}) > 1 for g in groups)    # some group spans nodes
    bandwidth = spec.network_bandwidth if across else spec.nvlink_bandwidth
    return (spec.collective_latency_s + sent / bandwidth if n > 1 else 0.0), sent


def _host_transfer(instr: dict, spec: GpuSpec) -> float:
    return array_bytes(instr["shape"]) / spec.host_bandwidth


def kernel_times(hlo_text: str, spec: GpuSpec, num_devices: int = 1, scope_weights: dict | None = None) -> dict:
    """Every kernel of the program with its modelled time; see the module docstring.

    `scope_weights` ({named scope: fraction of its loop's iterations that run it}) weights the
    executions of the kernels and collectives under a scope, as `flops.executed_dot_flops` does: a
    pipeline rank's tick-loop branches run in the ticks its schedule gives them. Those in a branch
    under no weighted scope count as if taken (`conditionals_upper_bound`).

    Returns {'kernels': [{name, computation, kind, flops, bytes, alu, bound, time_s (one
    execution), executions (weighted), in_conditional, scope}], 'collectives': [{name,
    computation, kind, time_s, sent_bytes, exposed_s, executions, scope}], 'loop_iterations',
    'conditionals_upper_bound', 'program'}."""
    program = equal_branches_once(parse_program(hlo_text))     # equal-cost branches: one taken
    fused = program.fused()
    weights = scope_weights or {}
    op_names = _op_names(program.parsed, lambda i: True) if weights else {}
    inherited = _computation_scopes(program.parsed, weights) if weights else {}

    def scope_for(comp: str, name: str):
        return (scope_of(op_names.get((comp, name), ""), weights) or inherited.get(comp)) if weights else None
    out = {"kernels": [], "collectives": [], "loop_iterations": 0, "conditionals_upper_bound": False}
    for comp, instrs in program.parsed.items():
        if program.mult[comp] != 0 and comp not in fused:
            _walk_computation(comp, instrs, program, spec, num_devices, weights, scope_for, out)
    for record in out["collectives"]:
        record.pop("hidden_s", None)
    return {**out, "program": program}


def _walk_computation(comp: str, instrs: list, program, spec: GpuSpec, num_devices: int, weights: dict,
                      scope_for, out: dict) -> None:
    """Add one computation's kernels and collectives to `out` (`kernel_times`' lists), in program
    order: an asynchronous collective hides the kernels that run between its start and its done."""
    mult = program.mult[comp]
    shapes = {i["name"]: i["shape"] for i in instrs}
    open_ = {}                          # async collectives in flight: name -> record
    for instr in instrs:
        op = instr["opcode"]
        if op == "while":
            trip = _TRIP_RE.search(instr["raw"])
            out["loop_iterations"] += mult * (int(trip.group(1)) if trip else 1)
        if op in NO_KERNEL or op.endswith("-done") and not _is_collective(op.removesuffix("-done") + "-start") \
                or 'custom_call_target="AllocateBuffer"' in instr["raw"]:
            continue
        if op.endswith("-done"):
            started = _operand_names(instr)[0]
            if started in open_:
                record = open_.pop(started)
                record["exposed_s"] = max(0.0, record["time_s"] - record.pop("hidden_s"))
            continue
        scope = scope_for(comp, instr["name"])     # a tick branch's work: in the ticks that take it
        runs = mult * weights[scope] if scope in weights else mult
        out["conditionals_upper_bound"] |= program.in_cond[comp] and scope is None
        if _is_collective(op):
            t, sent = _collective_time(instr, shapes, spec, num_devices)
            record = {"name": instr["name"], "computation": comp, "kind": op.removesuffix("-start"),
                      "time_s": t, "sent_bytes": sent, "exposed_s": t, "executions": runs, "scope": scope}
            if op.endswith("-start"):
                record = open_[instr["name"]] = record | {"hidden_s": 0.0}
            out["collectives"].append(record)
            continue
        if op == "copy-start":          # a host transfer, at the PCIe rate
            out["kernels"].append({"name": instr["name"], "computation": comp, "kind": "host-transfer", "flops": 0,
                                   "bytes": array_bytes(instr["shape"]), "alu": 0.0, "bound": "pcie",
                                   "time_s": _host_transfer(instr, spec), "executions": runs,
                                   "in_conditional": program.in_cond[comp], "scope": scope})
            continue
        record = _kernel_record(instr, comp, program, spec, shapes, runs) | {"scope": scope}
        out["kernels"].append(record)
        for pending in open_.values():
            pending["hidden_s"] += record["time_s"]


def _kernel_record(instr: dict, comp: str, program, spec: GpuSpec, shapes: dict, executions) -> dict:
    """One kernel's modelled time: the largest of its matmul, memory and ALU terms plus a launch."""
    k = _kernel(instr, comp, program, spec, shapes)
    terms = {"flops": k["flops"] / k["rate"], "memory": k["bytes"] / spec.memory_bandwidth,
             "alu": k["alu"] / spec.alu_ops}
    bound = max(terms, key=terms.get)
    return {"name": instr["name"], "computation": comp, "kind": k["kind"], "flops": k["flops"],
            "bytes": k["bytes"], "alu": k["alu"], "bound": bound, "time_s": terms[bound] + spec.launch_s,
            "executions": executions, "in_conditional": program.in_cond[comp]}
