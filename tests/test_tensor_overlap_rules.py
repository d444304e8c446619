"""Bad input for `parallel.tensor_overlap`: one line naming the field, at the config level (nothing compiles)."""
import pytest

from mtjax.config import ConfigError, load_config, validate

BATCH = ["train.global_batch=8", "train.micro_batch=4"]


@pytest.mark.parametrize("overrides,devices,words", [
    (["parallel.tensor=2"], 2, "sequence parallelism"),                                  # without SP
    ([], 1, "parallel.tensor > 1"),                                                      # t = 1
    (["parallel.tensor=4", "parallel.tensor_grid=2d"], 4, "tensor_grid=2d"),             # the tensor grid
], ids=["without_sp", "at_t1", "tensor_grid"])
def test_tensor_overlap_is_refused_in_one_line(overrides, devices, words):
    cfg = load_config(None, [*BATCH, "parallel.tensor_overlap=true", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, devices)
    assert e.value.key == "parallel.tensor_overlap" and "\n" not in str(e.value), str(e.value)
    assert words in str(e.value), str(e.value)


def test_tensor_overlap_with_sequence_parallelism_validates():
    cfg = load_config(None, [*BATCH, "parallel.tensor=2", "parallel.sequence_parallel=true",
                             "parallel.tensor_overlap=true"])
    assert validate(cfg, 2) == (1, 1, 2)
