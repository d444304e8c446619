"""What a layer keeps for its backward, against Korthikanti et al.'s count (`mtjax.activations`).

A GPT with both dropouts on (so that the 1-byte masks exist), MHA, s = 64, b = 2, h = 64, a = 8
(a/t = 1 head at t = 8), three layers. The saved set is traced (nothing is compiled); XLA's own
buffers are read from the buffer assignment of the compiled gradient.
"""
import pytest

from mtjax.activations import korthikanti_bytes, saved_bytes_per_layer, xla_stacked_bytes
from mtjax.config import load_config, validate
from tests.layouts import build

S, B, H, A = 64, 2, 64, 8
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True), (8, False), (8, True)]


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


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("t,sp", LAYOUTS, ids=[f"t{t}{'-sp' if sp else ''}" for t, sp in LAYOUTS])
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
