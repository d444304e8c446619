"""What a run prints, line by line, without running one: the start-up line's model, memory and
experts clauses (`training.metrics.startup_line`), and how a logged figure is written (`number`)."""
from mtjax.training.metrics import format_row


def test_the_start_up_line_names_the_model_and_its_experts():
    """No compile: the layout names a mixture of experts (E, k, e), the model clause its active
    parameters beside all of them, the memory figure its binary unit."""
    from layouts import build, tiny_config
    from mtjax.training.metrics import startup_line
    cfg = tiny_config("llama", data=2, micro_batch=1, extra=["model.num_experts=4", "model.moe_top_k=2",
                                                             "parallel.expert=2"])
    line = startup_line(build(cfg, 2, 1, 1).plan, cfg, "2 cpu devices", "corpus", 10_000, 3 * 2**20)
    experts = cfg.model.num_layers * 2 * cfg.model.hidden_size * cfg.model.expert_ffn_size * 3   # 2 of 4 idle
    assert "; experts 4 (top 2, expert parallel 2); " in line
    assert (f"; model llama: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, 8 heads (2 kv), "
            f"10,000 parameters ({10_000 - experts:,} active); memory per device 3.00 MiB (XLA's estimate of the "
            f"step); training to step {cfg.train.steps}; vocab ") in line, line


def test_large_figures_are_printed_in_whole_units():
    """tokens/s on a GPU and fp16's loss scale read as numbers, not 1.794e+04; small and huge
    ones keep 4 significant digits."""
    row = {"step": 3, "loss": 2.34567, "lr": 0.0009, "tokens_per_s": 17940.4, "loss_scale": 2.0 ** 32,
           "val_ppl": 5.2e21, "grad_norm": "nan"}
    assert format_row(row) == ("step 3 | loss 2.346 | lr 0.0009 | tokens_per_s 17940 | loss_scale 4294967296 | "
                               "val_ppl 5.2e+21 | grad_norm nan")


def test_a_logged_step_prints_its_step_out_of_train_steps(tmp_path, capsys):
    """`step N/T` with T the writer's total (train.steps), as Megatron's `iteration N/T`; the
    metrics.jsonl row keeps `step` N alone, as before."""
    import json
    from mtjax.training.metrics import MetricsWriter
    writer = MetricsWriter(str(tmp_path), 40, progress=False)
    writer.log(20, {"loss": 3.60349, "lr": 0.000122})
    writer.log(40, {"val_loss": 3.9})                   # a validation pass at a step not logged
    writer.close()
    assert capsys.readouterr().out.splitlines() == ["step 20/40 | loss 3.603 | lr 0.000122", "step 40/40 | val_loss 3.9"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
    assert rows == [{"step": 20, "loss": 3.60349, "lr": 0.000122}, {"step": 40, "val_loss": 3.9}]
