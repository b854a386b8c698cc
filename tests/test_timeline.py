"""fsharded.timeline: the measured collectives and phases of a step on real ranks."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import timeline_cases as T
import torch

import fsharded as fs
from fsharded.comm._trace import CommEvent, Span
from fsharded.timeline import RankRecord, Timeline

# What each manifest collective runs as on the transport.
_TRANSPORT_OP = {"psum": "all_reduce", "all_gather": "all_gather", "psum_scatter": "reduce_scatter"}


@pytest.mark.multiprocess
def test_zero3_step_on_two_gloo_ranks():
    from fsharded.testing import run_on_ranks

    res = sorted(run_on_ranks(T.zero3_step, 2, 3, "gloo"), key=lambda r: r["rank"])
    tl = res[0]["timeline"]
    assert [r.rank for r in tl.ranks] == [0, 1]
    assert asdict(res[0]["loaded"]) == asdict(tl)  # save / load keeps every number
    assert asdict(res[1]["timeline"]) == asdict(tl)  # every rank holds every rank's record

    def schedule(r):
        return [(e.op, e.nbytes, e.phase, e.asynchronous) for e in r.events]

    assert schedule(tl.ranks[0]) == schedule(tl.ranks[1])  # the same collectives on both ranks
    # The operands the transport moved are the manifest's, op for op.
    want: dict[str, int] = {}
    for e in res[0]["manifest"]:
        if e.bytes_sent:
            op = _TRANSPORT_OP[e.op]
            want[op] = want.get(op, 0) + math.prod(e.shape) * e.dtype.itemsize
    got: dict[str, int] = {}
    for e in tl.ranks[0].events:
        got[e.op] = got.get(e.op, 0) + e.nbytes
    assert got == want
    for r in tl.ranks:
        (step,) = [s for s in r.spans if s.name == "step"]
        backward = [(s.start, s.end) for s in r.spans if s.name == "backward"]
        assert len(backward) == 1 and backward[0][0] >= step.start and backward[0][1] <= step.end
        for e in r.events:
            assert step.start <= e.start <= e.end <= step.end
            if e.phase == "backward":
                assert backward[0][0] <= e.start <= backward[0][1]
        # ZeRO-3: the next block's gather prefetched in forward, gradients reduce-scattered
        # in backward while it goes on.
        assert any(e.op == "all_gather" and e.asynchronous and e.phase == "forward" for e in r.events)
        assert any(e.op == "reduce_scatter" and e.phase == "backward" for e in r.events)
        assert 0 <= tl.overlap_s(r.rank) <= tl.async_s(r.rank) + 1e-12
        assert tl.comm_s(r.rank) <= r.end - r.start
    text = res[0]["text"]
    assert "rank 0: 9 collectives" in text and "rank 1: 9 collectives" in text
    assert "all_gather         2        6,560  forward (async)" in text
    pytest.importorskip("matplotlib")
    fig = tl.figure()
    assert len(fig.axes[0].get_yticks()) == 4  # comm and phase lanes for each rank
    assert tl._repr_png_()[:4] == b"\x89PNG"


def test_on_the_virtual_mesh_nothing_is_timed():
    from fsharded.models import gpt

    cfg = gpt.GPTConfig.tiny(vocab_size=64)
    params = gpt.init(cfg, 0)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}))
    state = step.init(params)
    batch = {"tokens": torch.randint(0, 64, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))}
    with fs.timeline.record() as tl:
        step(state, batch)
    assert tl.virtual and tl.ranks == [] and tl._repr_png_() is None
    assert "no collectives were timed" in tl.text()


def test_overlap_arithmetic():
    ev = [CommEvent("all_reduce", 2, 8, "forward", 0.0, 2.0, False),
          CommEvent("all_gather", 2, 8, "forward", 1.0, 4.0, True),
          CommEvent("reduce_scatter", 2, 8, "backward", 3.0, 5.0, True),
          CommEvent("all_reduce", 2, 8, "forward", 4.5, 4.75, False)]
    tl = Timeline([RankRecord(0, 0.0, 6.0, ev, [Span("step", 0.0, 6.0)])])
    assert tl.comm_s() == pytest.approx(2.25)  # [0, 2] and [4.5, 4.75]
    assert tl.async_s() == pytest.approx(4.0)  # [1, 5]
    assert tl.overlap_s() == pytest.approx(4.0 - 1.0 - 0.25)  # minus [1, 2] and [4.5, 4.75]
    assert tl.span_s("step") == 6.0
    with pytest.raises(KeyError, match="no record of rank 3"):
        tl.comm_s(3)


def test_recordings_do_not_nest():
    with fs.timeline.record(), pytest.raises(RuntimeError, match="already open"):
        with fs.timeline.record():
            pass
