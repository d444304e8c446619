"""Per-device memory from XLA's buffer assignment (`memory_report`), and the HLO right after SPMD
partitioning (`partitioned_hlo`)."""


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
