"""The varying-axes typing assumed while a data-parallel loss runs (``VmaMode.assuming``):
the same numbers as typing every op, on the virtual mesh and on gloo ranks; a loss that
needs the typing (it reduces a differentiated value over the batch axis, or asks the type
of a value the assumption does not cover) is run again typed, with the same keys, and
later steps stay typed."""

from __future__ import annotations

import contextlib

import assumed_typing_cases as C
import optree
import pytest
import torch


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(torch.as_tensor(x), torch.as_tensor(y))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_assumed_equals_typed_and_skips_the_per_op_typing(stage):
    fast = C.run("plain", {"data": 2}, stage=stage)
    typed = C.run("plain", {"data": 2}, stage=stage, assume=False)
    _same(fast, typed)
    # The typing saw the step's own ops only (gathers, marks), not the loss's.
    assert fast["ops"][-1] * 3 < typed["ops"][-1], (fast["ops"], typed["ops"])


@pytest.mark.parametrize("kind", ["centred", "swallowed", "asks"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_loss_that_needs_the_typing_runs_typed(kind, stage):
    fast = C.run(kind, {"data": 2}, stage=stage)
    typed = C.run(kind, {"data": 2}, stage=stage, assume=False)
    _same(fast, typed)
    # Typed from the first step on (its loss ran again typed), as many ops as the typed run.
    assert fast["ops"][1:] == typed["ops"][1:]


def test_the_typing_matters_for_the_centred_loss(monkeypatch):
    # Without the implicit pvary the mean's gradient would be a shard's own: check that
    # the centred loss is one where the typing changes the gradients (the test above
    # would otherwise not tell a skipped insertion from a kept one).
    monkeypatch.setitem(C.DROPOUT, "p", 0.0)
    params = C.init()
    batch = C.batches(1)[0]
    import fsharded as fs
    from fsharded import P

    def grads(kind, mesh, assume=True):
        with contextlib.nullcontext() if assume else C._typed_only():
            step = fs.train_step(C.loss_for(kind), fs.optim.sgd(1.0), mesh=fs.Mesh(mesh), param_specs=P(),
                                 blocks="blocks")
            state, _ = step(step.init(params), batch)
        return [a - b for a, b in zip(optree.tree_leaves(step.params(state)), optree.tree_leaves(params))]

    # One device has no typing at all; two shards typed must equal it (the mean over the
    # batch shards is the global mean), and so must the assumed run that falls back.
    one = grads("centred", {"data": 1})
    for assume in (True, False):
        for a, b in zip(one, grads("centred", {"data": 2}, assume)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Were the assumption kept through the reduction (no implicit pvary where the mean
    # meets the shard's values), the gradients would be wrong: the fallback is what saves them.
    from fsharded.spmd import _vma

    monkeypatch.setattr(_vma.VmaMode, "stop_assuming", lambda self: None)
    kept = grads("centred", {"data": 2})
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(one, kept))


def test_accumulation_and_frozen_run_assumed():
    fast = C.run("plain", {"data": 2}, accumulation=2)
    typed = C.run("plain", {"data": 2}, accumulation=2, assume=False)
    _same(fast, typed)
    assert fast["ops"][-1] * 3 < typed["ops"][-1]


@pytest.mark.multiprocess
def test_gloo_ranks_assumed_equal_typed_and_fall_back():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(C.cases, 2, 2):
        for kind in C.BLOCKS:
            for stage in (0, 1, 3):
                fast, typed = res[kind, stage, True], res[kind, stage, False]
                _same(fast, typed)
                if kind == "plain":
                    assert fast["ops"][-1] * 3 < typed["ops"][-1], (stage, fast["ops"], typed["ops"])
                else:
                    assert fast["ops"][1:] == typed["ops"][1:], (kind, stage)


@pytest.mark.parametrize("kind", ["plain", "centred"])
def test_a_manifest_records_the_typed_collectives_once(kind):
    # step.collectives() records a step's collectives: it runs typed, so a loss that would
    # stop the assumption does not leave a stopped attempt's collectives in the record.
    import fsharded as fs
    from fsharded import P

    params, batch = C.init(), C.batches(1)[0]
    inner = C.loss_for(kind)

    def loss(p, b):  # reads a value on the host: the record runs on copies of the values
        assert float(b["y"].abs().max()) < 1e9
        return inner(p, b)

    totals = {}
    for assume in (True, False):
        with contextlib.nullcontext() if assume else C._typed_only():
            step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=fs.Mesh({"data": 2}),
                                 param_specs=P(), blocks="blocks")
            state = step.init(params)
            m = step.collectives(state, batch)
        totals[assume] = (m.ops(), m.total_bytes())
    assert totals[True] == totals[False]
