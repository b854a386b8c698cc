"""Pipeline schedules as data: every built schedule passes the checks over a grid of
(ranks, stages per rank, micro-batches), 1F1B's bubble is (p - 1) / (m + p - 1), the split
backward (ZB-H1) and interleaving shrink it, and broken tables are refused naming the
first bad action."""

from __future__ import annotations

from fractions import Fraction

import pytest

from fsharded.parallel import pipeline as pp
from fsharded.parallel.pipeline import Action

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("p,m", GRID)
def test_every_schedule_passes_its_checks_with_the_bubble_and_memory_it_should_have(p, m):
    gp, fb, zb = (pp.check(f(p, m)) for f in (pp.gpipe, pp.one_f_one_b, pp.zero_bubble))
    assert gp.bubble == fb.bubble == Fraction(p - 1, m + p - 1)
    assert gp.peak_activations == (m,) * p  # GPipe keeps every micro-batch alive
    assert fb.peak_activations == tuple(min(p - r, m) for r in range(p))
    assert zb.peak_activations == fb.peak_activations  # H1: 1F1B's memory
    if p > 1:
        assert zb.bubble < fb.bubble
    # every (stage, micro-batch) ran forward and backward once, on its rank
    for plan, kinds in ((fb, "FB"), (zb, "FIW")):
        done = sorted((a.kind, a.stage, a.mb) for row in plan.spans for _, _, a in row)
        assert done == sorted((k, s, i) for k in kinds for s in range(p) for i in range(m))


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2), (3, 6, 2)])
def test_interleaving_divides_the_bubble(p, m, v):
    plan = pp.check(pp.interleaved(p, m, v))
    assert plan.bubble < pp.check(pp.one_f_one_b(p, m)).bubble
    assert {a.stage for row in plan.schedule.actions for a in row} == set(range(p * v))
    assert all(plan.schedule.rank_of(a.stage) == r for r, row in enumerate(plan.schedule.actions) for a in row
               if a.kind in ("F", "B"))  # compute on the rank holding its stage


def test_a_table_written_by_hand_is_the_built_schedule():
    mine = pp.Schedule.from_table(["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"], microbatches=3, name="1f1b")
    assert mine == pp.one_f_one_b(2, 3)
    assert [str(a) for a in mine.actions[1][:4]] == ["RECV act 0 stage 0 from 0", "F0", "B0", "SEND grad 0 stage 1 to 0"]
    assert pp.check(mine).bubble == Fraction(1, 4)
    text = pp.timeline(mine)
    assert text.splitlines()[0].startswith("rank 0: F0") and "bubble 0.250" in text


@pytest.mark.parametrize("rows,m,message", [
    (["B0 F0"], 1, r"rank 0, action 0 \(B0\): backward of micro-batch 0 on stage 0 before its forward"),
    (["F0", "F0 B0"], 1, "no backward of micro-batch 0 on stage 0"),
    (["F0 I0", "F0 B0"], 1, "no backward of micro-batch 0 on stage 0 .a B, or both I and W"),
    (["F0 B0 F0", "F0 B0"], 1, r"rank 0, action 4 \(F0\): runs twice"),
    (["F0 W0 I0", "F0 B0"], 1, r"\(W0\): weight gradient of micro-batch 0 on stage 0 before its input gradient"),
    (["F0 X0"], 1, "'X0' is not an action"),
    (["F0 B0", "F0 B0"], 2, "no forward of micro-batch 1 on stage 0"),
])
def test_a_broken_table_is_refused_naming_the_action(rows, m, message):
    with pytest.raises(pp.ScheduleError, match=message):
        pp.check(pp.Schedule.from_table(rows, microbatches=m))


def _edit(s: pp.Schedule, r: int, actions: list[Action]) -> pp.Schedule:
    rows = list(s.actions)
    rows[r] = tuple(actions)
    return pp.Schedule(s.name, s.ranks, s.virtual, s.microbatches, tuple(rows))


def test_a_missing_receive_a_missing_send_and_a_deadlock_are_refused():
    s = pp.one_f_one_b(2, 1)  # rank 0: F0 SEND-act RECV-grad B0; rank 1: RECV-act F0 B0 SEND-grad
    r0, r1 = list(s.actions[0]), list(s.actions[1])
    assert [str(a) for a in r0] == ["F0", "SEND act 0 stage 0 to 1", "RECV grad 0 stage 1 from 1", "B0"]
    with pytest.raises(pp.ScheduleError, match=r"rank 1, action 0 \(F0\): its input .* no receive before it"):
        pp.check(_edit(s, 1, r1[1:]))
    with pytest.raises(pp.ScheduleError, match=r"rank 1, action 0 \(RECV act 0 stage 0 from 0\): rank 0 never "
                                               r"sends it"):
        pp.check(_edit(s, 0, [r0[0], r0[2], r0[3]]))
    with pytest.raises(pp.ScheduleError, match=r"rank 0, action 0 \(SEND act 0 stage 0 to 1\): sent before the "
                                               r"action that makes it"):
        pp.check(_edit(s, 0, [r0[1], r0[0], r0[2], r0[3]]))
    # each rank waits first for what the other sends later: a cycle
    cycle = _edit(s, 0, [r0[2], r0[0], r0[1], r0[3]])
    with pytest.raises(pp.ScheduleError, match=r"deadlock.*rank 0 at action 0 \(RECV grad 0 stage 1 from 1\).*"
                                               r"rank 1 at action 0 \(RECV act 0 stage 0 from 0\)"):
        pp.check(cycle)


def test_actions_on_the_wrong_rank_and_bad_sizes_are_refused():
    s = pp.one_f_one_b(2, 1)
    with pytest.raises(pp.ScheduleError, match=r"rank 0, action 0 \(F0\): stage 1 lives on rank 1"):
        pp.check(_edit(s, 0, [Action("F", 0, 1)]))
    with pytest.raises(pp.ScheduleError, match="multiple of the ranks"):
        pp.interleaved(2, 3, 2)
    with pytest.raises(pp.ScheduleError, match="at least 2"):
        pp.interleaved(2, 2, 1)
    with pytest.raises(pp.ScheduleError, match="positive int"):
        pp.one_f_one_b(0, 4)
    with pytest.raises(pp.ScheduleError, match="no pipeline schedule named 'pipedream'; known: gpipe, 1f1b"):
        pp.make("pipedream", 2, 4)
    assert pp.make("interleaved", 2, 4, 2) == pp.interleaved(2, 4, 2) and pp.make("zb", 2, 2) == pp.zero_bubble(2, 2)


def test_the_timeline_picture_draws_every_compute_action_where_the_plan_puts_it(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from fsharded.plot import pipeline_figure

    plan = pp.check(pp.zero_bubble(3, 4))
    fig = pipeline_figure(plan)
    boxes = [(round(b.get_y() + b.get_height() / 2), b.get_x(), b.get_width()) for b in fig.axes[0].patches]
    want = [(r, float(b), float(e - b)) for r, row in enumerate(plan.spans) for b, e, _ in row]
    assert sorted(boxes) == sorted(want)
    assert f"bubble {float(plan.bubble):.3f}" in fig.axes[0].get_title()
    fig.savefig(tmp_path / "zb.png")
    assert (tmp_path / "zb.png").stat().st_size > 1000


def test_a_plan_under_costs_per_action_measured_or_given():
    # costs as a function of (rank, action), e.g. the durations a run measured
    s = pp.make("1f1b", 2, 4)
    by_kind = pp.check(s, {"F": 1, "B": 2})
    same = pp.check(s, lambda r, a: {"F": 1, "B": 2}[a.kind])
    assert same.spans == by_kind.spans and same.bubble == by_kind.bubble
    doubled = pp.check(s, lambda r, a: 2 * {"F": 1, "B": 2}[a.kind])
    assert doubled.makespan == 2 * by_kind.makespan and doubled.bubble == by_kind.bubble
    # a slower last stage (its actions 3x): the first rank waits on it, the makespan grows by
    # the last rank's extra work at least, and the bubble with it
    slow = pp.check(s, lambda r, a: (3 if r == 1 else 1) * {"F": 1, "B": 2}[a.kind])
    assert slow.makespan >= by_kind.makespan + 2 * 4 * 3 and slow.bubble > by_kind.bubble


# -- ZeRO-3's weight actions -----------------------------------------------------------------

def _weights(row):
    return [(a.kind, a.stage) for a in row if a.kind in ("GATHER", "RELEASE")]


@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (3, 5), (4, 8)])
def test_with_gathers_gathers_each_stage_once_a_step_ahead_and_releases_it_after_its_last_use(p, m):
    """One stage per rank: one gather before everything, one release after the last backward
    (the last W under ZB-H1); the bubble and the activations are the table's own."""
    for make in (pp.one_f_one_b, pp.zero_bubble, pp.gpipe):
        s = make(p, m)
        g = pp.with_gathers(s)
        plan, base = pp.check(g), pp.check(s)
        assert (plan.bubble, plan.peak_activations) == (base.bubble, base.peak_activations)
        assert plan.peak_gathered == (1,) * p
        for r, row in enumerate(g.actions):
            assert _weights(row) == [("GATHER", r), ("RELEASE", r)]
            assert row[0].kind == "GATHER"
            last = max(k for k, a in enumerate(row) if a.kind in pp._table.COMPUTE)
            assert row[-1].kind == "RELEASE" and all(a.kind == "SEND" for a in row[last + 1:-1])
            assert [a for a in row if a.kind not in ("GATHER", "RELEASE")] == list(s.actions[r])


def test_with_gathers_on_interleaved_prefetches_each_chunk_and_releases_it_when_done():
    s = pp.interleaved(2, 4, 2)
    g = pp.with_gathers(s)  # both chunks once per step; the one finished first released first
    assert pp.check(g).peak_gathered == (2, 2)
    assert pp.check(g).bubble == pp.check(s).bubble
    for r, row in enumerate(g.actions):
        assert sorted(_weights(row)) == sorted([("GATHER", r), ("GATHER", r + 2), ("RELEASE", r), ("RELEASE", r + 2)])
        compute = [k for k, a in enumerate(row) if a.kind in pp._table.COMPUTE]
        # the second chunk's gather comes one compute action before its first use
        first = next(j for j, k in enumerate(compute) if row[k].stage == r + 2)
        at = next(k for k, a in enumerate(row) if a.kind == "GATHER" and a.stage == r + 2)
        assert compute[first - 2] < at < compute[first - 1]
        # a chunk's release follows its last compute action (and the sends after it)
        for st in (r, r + 2):
            last = max(k for k in compute if row[k].stage == st)
            rel = next(k for k, a in enumerate(row) if a.kind == "RELEASE" and a.stage == st)
            assert rel > last and all(row[k].kind in ("SEND", "RELEASE") for k in range(last + 1, rel))
    # rank 0's chunk 2 finishes before its chunk 0: released while chunk 0 still computes
    row = g.actions[0]
    rel2 = next(k for k, a in enumerate(row) if a.kind == "RELEASE" and a.stage == 2)
    assert any(a.kind in pp._table.COMPUTE and a.stage == 0 for a in row[rel2:])
    with pytest.raises(pp.ScheduleError, match="already gathers"):
        pp.with_gathers(g)
    with pytest.raises(pp.ScheduleError, match="ahead >= 0"):
        pp.with_gathers(s, ahead=-1)
    # no prefetch: each gather right before (the receives of) its stage's first action
    now = pp.with_gathers(s, ahead=0)
    for r, row in enumerate(now.actions):
        for st in (r, r + 2):
            at = next(k for k, a in enumerate(row) if a.kind == "GATHER" and a.stage == st)
            nxt = next(a for a in row[at + 1:] if a.kind in pp._table.COMPUTE)
            assert nxt.stage == st


def test_a_release_between_a_forward_and_its_backward_is_refused():
    """The graph of a micro-batch in flight holds the stage's weights: releasing them there
    would free nothing (and a gather after it would hold a second copy)."""
    s = pp.one_f_one_b(2, 2)
    rows = [list(r) for r in pp.with_gathers(s).actions]
    row = [a for a in rows[1] if a.kind not in ("GATHER", "RELEASE")]
    f0 = next(k for k, a in enumerate(row) if a.kind == "F")
    row = [Action("GATHER", 0, 1)] + row[:f0 + 1] + [Action("RELEASE", 0, 1), Action("GATHER", 0, 1)] \
        + row[f0 + 1:] + [Action("RELEASE", 1, 1)]
    rows[1] = row
    bad = pp.Schedule("t", 2, 1, 2, tuple(tuple(r) for r in rows))
    with pytest.raises(pp.ScheduleError, match=r"micro-batches \[0\] are between their forward and their backward"):
        pp.check(bad)


@pytest.mark.parametrize("edit,message", [
    (lambda rows: [[a for a in rows[0] if a.kind != "GATHER"], rows[1]], "weights are not gathered here"),
    (lambda rows: [[rows[0][0]] + rows[0], rows[1]], "gathered already"),
    (lambda rows: [[a for a in rows[0] if a.kind != "RELEASE"], rows[1]], "never released"),
    (lambda rows: [rows[0] + [Action("RELEASE", 3, 0)], rows[1]], "not gathered here"),
    (lambda rows: [[Action("GATHER", 0, 1)] + rows[0], rows[1]], "stage 1 lives on rank 1"),
    (lambda rows: [rows[0], [a for a in rows[1] if a.kind not in ("GATHER", "RELEASE")]],
     "weights are not gathered here"),
])
def test_broken_weight_actions_are_refused_naming_the_action(edit, message):
    g = pp.with_gathers(pp.one_f_one_b(2, 4))
    rows = edit([list(r) for r in g.actions])
    bad = pp.Schedule(g.name, 2, 1, 4, tuple(tuple(r) for r in rows))
    with pytest.raises(pp.ScheduleError, match=message):
        pp.check(bad)


def test_the_plan_counts_sends_and_transfers_as_idle_when_given():
    """GPipe on 2 ranks, one micro-batch, F 1 and B 2: a send keeps its rank 1/2 and its
    value arrives 1/4 after it. By hand: rank 0 F [0, 1], send to 3/2; rank 1 receives at
    7/4, F to 11/4, B to 19/4, sends to 21/4; rank 0 receives at 11/2, B to 15/2. Each rank
    computes 3 of 15/2: a bubble of 3/5 (1/2 with free communication)."""
    s = pp.make("gpipe", 2, 1)
    free = pp.check(s)
    timed = pp.check(s, comm=lambda r, a: Fraction(1, 2) if a.kind == "SEND" else Fraction(1, 4))
    assert (free.makespan, free.bubble) == (6, Fraction(1, 2))
    assert (timed.makespan, timed.bubble, timed.busy) == (Fraction(15, 2), Fraction(3, 5), (3, 3))
    assert [(b, e) for b, e, _ in timed.spans[1]] == [(Fraction(7, 4), Fraction(11, 4)), (Fraction(11, 4), Fraction(19, 4))]
