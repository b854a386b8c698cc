"""fsharded plot: a run's JSONL metrics as a picture, one panel per metric, one line per run."""

from __future__ import annotations

import json

import pytest
import torch

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


def _stages():
    import fsharded as fs
    from fsharded import P
    from fsharded.models import gpt

    cfg = gpt.GPTConfig.tiny(vocab_size=64)
    params = gpt.init(cfg, 0)
    batch = {"tokens": torch.randint(0, 64, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))}
    mesh = fs.Mesh({"data": 2})
    opt = fs.optim.adamw(1e-3)
    out = {}
    for stage, precision in ((0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "fp16")):
        plan = fs.parallel.zero(stage, min_size=16)(P(), params)
        step = fs.train_step(gpt.loss, opt, mesh=mesh, param_specs=plan, precision=precision, blocks="blocks")
        est = fs.estimate_memory(params, plan, opt, mesh=mesh, precision=precision, loss=gpt.loss, batch=batch)
        out[f"ZeRO-{stage} {precision}"] = (est, step.collectives(step.init(params), batch))
    return out



def test_memory_breakdown_adds_up_to_the_peak_and_the_bars_show_it():
    from fsharded.plot import memory_figure

    ests = {k: e for k, (e, _) in _stages().items()}
    for label, est in ests.items():
        moment, parts = est.breakdown()
        assert sum(parts.values()) == est.peak, label
        assert moment in ("backward", "after backward", "gather")
        assert parts["master weights"] == est.master and parts["optimizer state"] == est.optimizer
    assert ests["ZeRO-3 fp16"].breakdown()[1]["parameters"] > 0  # fp16 copies held
    fig = memory_figure(ests)
    ax = fig.axes[0]
    div = 2**10  # the largest peak is over 1 KiB and under 1 MiB here
    assert ax.get_ylabel() == "KiB"
    for i, est in enumerate(ests.values()):
        heights = sum(p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - i) < 1e-9)
        assert heights == pytest.approx(est.peak / div)
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"master weights", "optimizer state"}


def test_collectives_bars_are_the_manifest_bytes_by_op_axis_and_phase():
    from fsharded.plot import collectives_figure

    mans = {k: m for k, (_, m) in _stages().items()}
    fig = collectives_figure(mans)
    ax = fig.axes[0]
    for i, man in enumerate(mans.values()):
        bars = [p for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - i) < 1e-9]
        div = 2**10 if max(m.total_bytes() for m in mans.values()) >= 2**10 else 1
        assert sum(p.get_height() for p in bars) == pytest.approx(man.total_bytes() / div)
        back = sum(e.bytes_sent for e in man if e.phase == "backward")
        assert sum(p.get_height() for p in bars if p.get_hatch()) == pytest.approx(back / div)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "all_gather over data" in labels  # ZeRO-3's gathers
    assert any(lab.endswith("(in backward)") for lab in labels)
    with pytest.raises(ValueError, match="no manifests"):
        collectives_figure({})
