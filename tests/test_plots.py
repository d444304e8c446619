"""`--plot` draws the schedule at the costs the command prints: the picture's title gives the
same time over ideal as the text, and the slots' widths follow the costs."""
import re

import pytest

pytest.importorskip("matplotlib")

from mtjax.commands.pipeline import main as pipeline_main  # noqa: E402


@pytest.mark.parametrize("extra", [["--costs", "1,1,0.5"], ["--costs", "1,1,0.5", "--recompute"], []])
def test_the_plot_title_is_at_the_printed_costs(tmp_path, capsys, monkeypatch, extra):
    from matplotlib.figure import Figure
    titles = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (titles.append(self.axes[0].get_title()),
                                                                   save(self, *a, **k)))
    argv = ["show", "--schedule", "zb", "--stages", "4", "--micro-batches", "8", *extra, "--plot", str(tmp_path / "zb.png")]
    assert pipeline_main(argv) == 0
    printed = float(re.search(r"^time_over_ideal: (\S+)$", capsys.readouterr().out, re.M).group(1))
    (title,) = titles
    drawn = re.search(r"time over ideal (\d\.\d+)", title).group(1)
    assert drawn == f"{printed:.3f}", (title, printed)
    if extra == ["--costs", "1,1,0.5"]:
        assert drawn == "1.225"            # not 1.125, the figure at the default costs 1,1,1


def test_slot_widths_follow_the_costs():
    from mtjax.pipeline.schedules import make_schedule
    from mtjax.plots import _slots
    zb, one = make_schedule("zb", 4, 8), make_schedule("1f1b", 4, 8)
    assert _slots(zb, costs=(1, 1, 0.5)) == [("forward", 0.0, 0.4), ("backward", 0.4, 0.4), ("weight", 0.8, 0.2)]
    assert _slots(one) == [("forward", 0.0, 1 / 3), ("backward", 1 / 3, 2 / 3)]
    assert _slots(one, recompute=True) == [("forward", 0.0, 0.25), ("backward", 0.25, 0.75)]


def test_a_plot_that_cannot_be_written_whole_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A disk that fills while the image is written: one line naming --plot, no half image (and an
    image already there is kept as it was), no temporary file."""
    import errno
    from matplotlib.figure import Figure

    def full(self, f, *a, **k):
        f.write(b"<svg half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full)
    target = tmp_path / "zb.svg"
    argv = ["show", "--schedule", "zb", "--stages", "2", "--micro-batches", "4", "--plot", str(target)]
    for before in (None, b"an older picture"):
        if before is not None:
            target.write_bytes(before)
        assert pipeline_main(argv) == 1
        err = capsys.readouterr().err
        assert re.fullmatch(r"error: --plot: cannot write \S*zb\.svg: No space left on device; nothing was written\n",
                            err), err
        assert sorted(p.name for p in tmp_path.iterdir()) == ([] if before is None else ["zb.svg"])
        assert before is None or target.read_bytes() == before
