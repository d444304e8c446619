"""What a layer keeps for its backward, against Korthikanti et al.'s count (`mtjax.activations`).

A GPT with both dropouts on (so that the 1-byte masks exist), MHA, s = 64, b = 2, h = 64, a = 8
(a/t = 1 head at t = 8), three layers. The saved set is traced (nothing is compiled); XLA's own
buffers are read from the buffer assignment of the compiled gradient.
"""
import pytest

from mtjax.activations import grid_activation_terms, korthikanti_bytes, saved_bytes_per_layer, xla_stacked_bytes
from mtjax.config import load_config, validate
from tests.layouts import build

S, B, H, A = 64, 2, 64, 8


def trainer(t: int, sp: bool, mode: str, precision: str, dropout: float = 0.1, layers: int = 3):
    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={layers}", f"model.hidden_size={H}", f"model.num_heads={A}",
        f"model.seq_len={S}", f"model.dropout={dropout}", f"model.attention_dropout={dropout}",
        "parallel.data=1", f"parallel.tensor={t}", f"parallel.sequence_parallel={str(sp).lower()}",
        f"train.global_batch={B}", f"train.micro_batch={B}", f"train.precision={precision}",
        f"train.recompute={mode}"])
    validate(cfg, t)
    return build(cfg, 1, 1, t)


def test_formula_is_the_papers():
    """w = 2 with dropout gives Korthikanti et al.'s closed forms (Table 2 and section 5)."""
    sbh, t = S * B * H, 4
    assert korthikanti_bytes(S, B, H, A) == sbh * (34 + 5 * A * S / H)
    assert korthikanti_bytes(S, B, H, A, t) == sbh * (10 + 24 / t + 5 * A * S / (H * t))
    assert korthikanti_bytes(S, B, H, A, t, sp=True) == sbh / t * (34 + 5 * A * S / H)
    assert korthikanti_bytes(S, B, H, A, t, mode="selective") == sbh * (10 + 24 / t)
    assert korthikanti_bytes(S, B, H, A, t, sp=True, mode="selective") == 34 * sbh / t
    assert korthikanti_bytes(S, B, H, A, mode="full") == 2 * sbh
    with pytest.raises(ValueError, match="mode"):
        korthikanti_bytes(S, B, H, A, mode="block")


# Every mode with and without SP, every tensor size with and without SP: 10 of the 21 products
# (the formula is a sum of terms in 1/t, SP and the mode; the cut products repeat its pairs).
SAVED_SET = [(1, False, "none"), (1, False, "selective"), (1, False, "full"), (2, False, "selective"),
             (2, True, "none"), (2, True, "full"), (4, False, "full"), (4, True, "selective"),
             (8, False, "none"), (8, True, "selective")]


@pytest.mark.parametrize("t,sp,mode", SAVED_SET, ids=[f"t{t}{'-sp' if sp else ''}-{m}" for t, sp, m in SAVED_SET])
def test_saved_set_in_bf16_is_korthikantis_count(t, sp, mode):
    """The residuals autodiff keeps per layer and device in bf16 are within 10% of the formula
    (16-bit values, 1-byte masks); nothing of them is fp32 but the norms' row statistics."""
    saved = saved_bytes_per_layer(trainer(t, sp, mode, "bf16"))
    want = korthikanti_bytes(S, B, H, A, t, sp, mode)
    assert abs(saved["total"] / want - 1) < 0.10, (saved, want)
    assert saved.get("float32", 0) <= 2 * 2 * 4 * S * B / (t if sp else 1), saved   # 2 norms x (mean, 1/sigma)


def test_saved_set_without_dropout_has_no_masks():
    """Without dropout the masks go and P is P V's input itself: a s^2 b w / t, not 5 a s^2 b / t."""
    saved = saved_bytes_per_layer(trainer(2, True, "none", "bf16", dropout=0.0))
    want = korthikanti_bytes(S, B, H, A, 2, True, "none", dropout=False)
    assert "bool" not in saved and abs(saved["total"] / want - 1) < 0.10, (saved, want)


@pytest.mark.parametrize("t,sp,mode", [(1, False, "none"), (2, False, "none"), (2, True, "none"),
                                       (2, True, "selective"), (2, True, "full")])
def test_xla_keeps_what_autodiff_saves_in_fp32(t, sp, mode):
    """XLA:CPU's stacked residual buffers (the compiled gradient's buffers that carry the layer
    scan's residuals, weight gradients aside) are within 10% of the saved set, in fp32."""
    tr = trainer(t, sp, mode, "fp32")
    saved = saved_bytes_per_layer(tr)["total"]
    held = xla_stacked_bytes(tr)["activations"] / 3
    assert abs(held / saved - 1) < 0.10, (held, saved)


# ---- the 2D / 2.5D grid (`parallel.tensor_grid`): `grid_activation_terms` ---------------------------
GB = 4                                   # the micro-batch: d q = 4 row blocks on 2.5d (q = 2, d = 2)
GRIDS = [("gpt", "2d", 1), ("gpt", "2.5d", 2), ("llama", "2d", 1), ("llama", "2.5d", 2)]


def grid_trainer(arch: str, grid: str, depth: int, mode: str, precision: str, dropout: float = 0.1):
    """S, H, A as above on a q = 2 grid; Llama with k = 2 kv heads, SwiGLU (f = 192), RMSNorm, RoPE."""
    t = 4 * depth
    cfg = load_config(None, [
        f"model.arch={arch}", "model.num_layers=3", f"model.hidden_size={H}", f"model.num_heads={A}",
        f"model.num_kv_heads={2 if arch == 'llama' else 0}", f"model.seq_len={S}", f"model.dropout={dropout}",
        "parallel.data=1", f"parallel.tensor={t}", f"parallel.tensor_grid={grid}", f"parallel.tensor_depth={depth}",
        f"train.global_batch={GB}", f"train.micro_batch={GB}", f"train.precision={precision}",
        f"train.recompute={mode}"])
    validate(cfg, t)
    return build(cfg, 1, 1, t), cfg.model


def grid_terms(model, depth: int, mode: str, width: int, dropout: bool) -> dict:
    return grid_activation_terms(S, GB, H, A, 2, depth, mode, width, dropout, model.kv_heads, model.ffn_size,
                                 model.mlp_activation == "swiglu", model.arch == "llama")


def test_grid_formula_reduces_to_korthikantis():
    """On a grid of t = d q^2, with k = a, f = 4h and GeLU, the count less the norms' statistics is
    1D + SP's at t without attention dropout (its mask and output, a s^2 b (w + 1)/t); at q = d = 1
    the paper's t = 1 count, sbh(34 + 2as/h) at w = 2."""
    for q, d in ((1, 1), (2, 1), (2, 2), (4, 4)):
        t = d * q * q
        for mode in ("none", "selective", "full"):
            terms = grid_activation_terms(S, B, H, A, q, d, mode)
            attention_dropout = A * S * S * B * 3 / t if mode == "none" else 0.0
            assert sum(terms.values()) - terms["statistics"] == pytest.approx(
                korthikanti_bytes(S, B, H, A, t, True, mode) - attention_dropout)
    terms = grid_activation_terms(S, B, H, A, 1)
    assert sum(terms.values()) - terms["statistics"] == pytest.approx(S * B * H * (34 + 2 * A * S / H))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("arch,grid,depth", GRIDS, ids=[f"{a}-{g}" for a, g, _ in GRIDS])
def test_grid_saved_set_is_the_formula(arch, grid, depth, mode):
    """The residuals autodiff keeps per layer and device on 2d (t = 4) and 2.5d (t = 8), bf16 with
    dropout, are the formula's term by term: the 16-bit values (and P), the 1-byte masks, the fp32
    norm statistics, each within 1% (by dtype, so that a dropped term fails, the smallest too)."""
    tr, model = grid_trainer(arch, grid, depth, mode, "bf16")
    saved, terms = saved_bytes_per_layer(tr), grid_terms(model, depth, mode, 2, True)
    want = {"bfloat16": terms["values"] + terms["attention"], "bool": terms["masks"], "float32": terms["statistics"]}
    for dtype, nbytes in want.items():
        assert saved.get(dtype, 0.0) == pytest.approx(nbytes, rel=0.01), (dtype, saved, terms)
    assert saved["total"] == pytest.approx(sum(terms.values()), rel=0.01), (saved, terms)


@pytest.mark.parametrize("arch,grid,depth,mode", [("gpt", "2d", 1, "none"), ("llama", "2.5d", 2, "selective")])
def test_grid_xla_keeps_the_formula_in_fp32(arch, grid, depth, mode):
    """fp32 without dropout: the saved set is the formula, and XLA:CPU's stacked residual buffers
    of the compiled gradient are within 10% of it."""
    tr, model = grid_trainer(arch, grid, depth, mode, "fp32", dropout=0.0)
    want = sum(grid_terms(model, depth, mode, 4, False).values())
    saved = saved_bytes_per_layer(tr)
    assert "bool" not in saved and saved["total"] == pytest.approx(want, rel=0.01), (saved, want)
    held = xla_stacked_bytes(tr)["activations"] / 3
    assert abs(held / want - 1) < 0.10, (held, want)
