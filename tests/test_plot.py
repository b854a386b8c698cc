"""fsharded plot: a run's JSONL metrics as a picture, one panel per metric, one line per run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from fsharded import cli  # noqa: E402
from fsharded.plot import plot_metrics, read_metrics  # noqa: E402


def _write(path, losses, extra=None):
    with open(path, "w") as f:
        for i, loss in enumerate(losses):
            f.write(json.dumps({"step": i + 1, "loss": loss, "grad_norm": 1.0 / (i + 1), "lr": 1e-3,
                                **(extra or {})}) + "\n")
    return path


def test_plot_draws_each_metric_of_each_run(tmp_path, capsys):
    import matplotlib.image as mpimg

    a = _write(tmp_path / "a.jsonl", [3.0, 2.5, 2.0], {"moe_drop_fraction": 0.1})
    b = _write(tmp_path / "b.jsonl", [3.1, 2.4, 1.9])
    out = tmp_path / "m.png"
    assert cli.main(["plot", str(a), str(b), "-o", str(out), "--labels", "virtual,gloo"]) == 0
    assert "loss, grad_norm, lr, moe_drop_fraction of 2 run(s)" in capsys.readouterr().out
    img = mpimg.imread(out)
    assert img.shape[0] > 100 and img.shape[1] > 300  # a 2 x 3 grid of panels
    assert plot_metrics([a], tmp_path / "k.png", keys=["lr", "loss"]) == ["lr", "loss"]


def test_bad_files_are_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        read_metrics(bad)
    assert cli.main(["plot", str(bad), "-o", str(tmp_path / "x.png")]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err
    good = _write(tmp_path / "g.jsonl", [1.0])
    with pytest.raises(ValueError, match=r"no metric \['accuracy'\]"):
        plot_metrics([good], tmp_path / "y.png", keys=["accuracy"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics records"):
        read_metrics(tmp_path / "empty.jsonl")
