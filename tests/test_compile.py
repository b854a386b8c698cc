"""``train_step(compile=True)``: the step captured as one graph and compiled, against eager.

The strategies run through the captured graph with torch.compile's ``eager`` backend (the
graph's ops as captured, no code generation: what could drop or change a gradient is the
capture); the bundled GPT and fp16's skipped steps through Inductor too."""

from __future__ import annotations

import json
import warnings

import compile_cases as C
import optree
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded.models import gpt
from fsharded.step import _compile

# fp16 starting at a loss scale its gradients overflow at: the first steps are skipped
# and the scale halves until they fit.
FP16 = fs.precision.Policy.fp16(loss_scale=fs.precision.DynamicLossScale(initial_scale_power=20, hysteresis=1))


@pytest.fixture(scope="module")
def batches():
    return T.batches(C.STEPS)


def test_the_compiled_gpt_step_equals_eager_and_reads_nothing_on_the_host(batches):
    got, _ = C.both(lambda c: C.gpt_step(c), batches)  # Inductor
    # The first call captured and compiled; the others ran the compiled graph.
    assert got["compile_s"][0] > 0 and got["compile_s"][1:] == [0.0] * (C.STEPS - 1)
    step, params = C.gpt_step(True)
    state = step.init(params)
    gm = step.graph(state, batches[0])
    assert _compile.host_reads(gm) == [] and _compile.global_draws(gm) == []
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "aten._local_scalar_dense.default" not in ops and "aten.item.default" not in ops
    # Forward, backward and the update are in it: three products per weight per layer
    # (the forward's and the two of its gradient), and one sqrt per moment (Adam's).
    mms = sum(op.startswith(("aten.mm", "aten.addmm", "aten.bmm")) for op in ops)
    assert mms >= 3 * 4 * T.CONFIG.n_layers
    assert sum(op.startswith("aten.sqrt") for op in ops) >= len(optree.tree_leaves(params))


@pytest.mark.parametrize("case", ["bf16", "fp16", "accumulation", "remat", "remat-dots", "zero3-blocks", "sgd"])
def test_each_strategy_compiled_equals_eager(batches, case):
    make = {
        "bf16": lambda c: C.gpt_step(c, precision="bf16"),
        "fp16": lambda c: C.gpt_step(c, precision=FP16),
        "accumulation": lambda c: C.gpt_step(c, accumulation=2),
        "remat": lambda c: C.gpt_step(c, remat="blocks", blocks="blocks"),
        "remat-dots": lambda c: C.gpt_step(c, remat="blocks,dots", blocks="blocks"),
        "zero3-blocks": lambda c: C.gpt_step(c, stage=3, blocks="blocks"),
        "sgd": lambda c: C.gpt_step(c, optimizer=fs.optim.sgd(0.1, momentum=0.9)),
    }[case]
    tol = 1e-5 if case not in ("bf16", "fp16") else 2e-3
    got, eager = C.both(make, batches, tol=tol, backend="eager")
    if case == "fp16":  # the first loss scales overflow: the same steps skipped, the same scales
        assert sum(got["skipped"]) > 0 and got["skipped"] == eager["skipped"]


def test_fp16_overflows_are_skipped_by_the_inductor_graph_as_eagerly(batches):
    got, eager = C.both(lambda c: C.gpt_step(c, precision=FP16), batches, tol=2e-3)
    assert got["skipped"] == eager["skipped"] and 0 < got["skipped"][-1] < C.STEPS
    assert got["scales"] == eager["scales"]


def test_a_hugging_face_gpt2_with_dropout_draws_the_eager_masks(batches):
    got, eager = C.both(lambda c: C.hf_gpt2_step(c), batches, backend="eager")
    # (dropout is on: the same masks, drawn from the step's key inside the graph)
    nodrop = C.train(*C.hf_gpt2_step(False, dropout=0.0), batches)
    assert nodrop["losses"] != eager["losses"]


def test_a_loss_drawing_from_torchs_generator_is_refused(batches):
    step, params = C.hf_gpt2_step("eager", seed=None)  # dropout from torch's global generator
    with pytest.raises(RuntimeError, match="draws from torch's global generator"):
        step(step.init(params), batches[0])


def test_a_new_graph_only_for_a_new_shape_or_dtype(batches):
    step, params = C.gpt_step("eager")
    state = step.init(params)
    b8 = batches[0]
    b4 = {"tokens": b8["tokens"][:4]}
    short = {"tokens": b8["tokens"][:, :9]}
    seen = []
    for b in (b8, b8, b4, b8, b4, short, b8):
        state, m = step(state, b)
        seen.append((step.compiles, float(m["compile_s"]) > 0))
    assert seen == [(1, True), (1, False), (2, True), (2, False), (2, False), (3, True), (3, False)]
    # A batch of another dtype is another signature too.
    step = fs.train_step(lambda p, b: ((b["x"].to(p["w"].dtype) @ p["w"]) ** 2).mean(), fs.optim.sgd(0.1),
                         compile="eager")
    state = step.init({"w": torch.ones(3, 2)})
    for dtype in (torch.float32, torch.float64, torch.float32):
        state, _ = step(state, {"x": torch.ones(4, 3, dtype=dtype)})
    assert step.compiles == 2


def _decay(total: int):
    return fs.optim.WarmupDecayLR(warmup_min_lr=0.0, warmup_max_lr=0.0123, warmup_num_steps=2,
                                  total_num_steps=total)


def _matmul_loss(p, b):
    return ((b["x"] @ p["w"]) ** 2).mean()


def test_the_learning_rate_is_an_input_of_the_graph_not_its_schedule():
    # The rates are computed before the step and passed in: two schedules (another run
    # length) capture the same graph, so a second job of another --steps compiles from the
    # cache; each step still applies its own rate, as eagerly.
    b = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    codes = []
    for total in (10, 20):
        step = fs.train_step(_matmul_loss, fs.optim.adamw(_decay(total)), compile="eager")
        codes.append(step.graph(step.init({"w": torch.ones(3, 2)}), b).code)
    assert codes[0] == codes[1]
    assert "0.0123" not in codes[0]  # (no rate is a constant of the graph)
    # A schedule with Python branches on the step (a host read when traced) runs compiled.
    branchy = lambda step: 1e-2 if int(step) < 2 else 1e-3  # noqa: E731
    for opt in (fs.optim.adamw(_decay(6)), fs.optim.sgd(branchy, momentum=0.9)):
        runs = {}
        for c in ("eager", False):
            step = fs.train_step(_matmul_loss, opt, compile=c)
            state, got = step.init({"w": torch.ones(3, 2)}), []
            for _ in range(5):
                state, m = step(state, b)
                got.append((float(m["lr"]), state.params["w"].clone()))
            runs[c] = got
            assert step.compiles == (1 if c else 0)
        assert [r for r, _ in runs["eager"]] == [r for r, _ in runs[False]]
        assert len({r for r, _ in runs[False]}) > 1  # (the rate changed along the steps)
        for (_, a), (_, e) in zip(runs["eager"], runs[False]):
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("same", [False, True])
def test_two_rates_of_one_schedule_are_each_their_own_counters_as_eagerly(same):
    # One schedule object in two transformations at different counts (the second counter
    # ahead): each is given the rate of its own counter, not one rate per schedule. The
    # same transformation twice (one token, two counters) computes its rates in the graph.
    sched = _decay(8)
    t = fs.optim.scale_by_learning_rate(sched)
    opt = fs.optim.chain(t, t if same else fs.optim.scale_by_learning_rate(sched))
    b = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(1))}
    finals = {}
    for c in ("eager", False):
        step = fs.train_step(_matmul_loss, opt, compile=c)
        state = step.init({"w": torch.ones(3, 2)})
        inner = list(state.opt_state)
        inner[1] = inner[1]._replace(count=torch.tensor(3))
        state = state._replace(opt_state=tuple(inner))
        for _ in range(4):
            state, _ = step(state, b)
        finals[c] = state.params["w"]
    assert not torch.equal(finals[False], torch.ones(3, 2))
    torch.testing.assert_close(finals["eager"], finals[False], rtol=1e-6, atol=1e-7)


def test_bad_input_is_the_eager_steps_error(batches):
    step, params = C.gpt_step("eager")
    with pytest.raises(RuntimeError, match="expected target dtype to be Long"):
        step(step.init(params), {"tokens": batches[0]["tokens"].to(torch.int32)})


@pytest.mark.parametrize("donate", [False, True])
def test_a_nonfinite_step_is_refused_and_the_state_kept(batches, donate):
    step, params = C.gpt_step("eager", donate=donate)
    state = step.init(params)
    state, _ = step(state, batches[0])
    kept = [x.clone() for x in optree.tree_leaves((state.params, state.opt_state))]
    bad = dict(state.params, emb=state.params["emb"].clone())
    bad["emb"][0, 0] = float("nan")
    bad_state = state._replace(params=bad)
    with pytest.raises(FloatingPointError, match="not applied"):
        step(bad_state, batches[1])
    # (donated: the graph wrote its kept values back into the buffers passed in)
    assert all(torch.equal(a, b) for a, b in zip(kept, optree.tree_leaves((state.params, state.opt_state))))
    assert torch.isnan(bad_state.params["emb"][0, 0])  # (the state passed in, as it was)


@pytest.mark.parametrize("kw", [dict(on_nonfinite="skip"), dict(check_finite=False, accumulation=2)],
                         ids=["guarded", "unguarded, accumulated"])
def test_a_donated_compiled_step_updates_the_state_in_its_own_buffers(batches, kw):
    # The graph writes the new parameters and moments into the state passed in (inputs
    # mutated at its end), as the eager donated step does, with its numbers; a skipped
    # non-finite step leaves them as they were and advances the counters.
    runs = {}
    for c in (False, "eager"):
        step, params = C.gpt_step(c, mesh={"data": 2}, donate=True, **kw)
        state = step.init(params)
        start = [x.clone() for x in optree.tree_leaves((state.params, state.opt_state))]
        losses = []
        for i, b in enumerate(batches):
            before = state
            state, m = step(state, b)
            losses.append(float(m["loss"]))
            if i == 0 and c:  # (a graph's first run writes into copies: the state passed to it stays whole)
                assert all(torch.equal(a, b) for a, b in zip(start, optree.tree_leaves((before.params,
                                                                                        before.opt_state))))
            if i == 0:
                second = [x for x in optree.tree_leaves((state.params, state.opt_state)) if x.dim() > 0]
                at_second = [x.clone() for x in second]
        # The tensors passed in at the second step hold the last step's values.
        final = [x for x in optree.tree_leaves((state.params, state.opt_state)) if x.dim() > 0]
        assert all(torch.equal(a, b) for a, b in zip(second, final))
        assert not all(torch.equal(a, b) for a, b in zip(at_second, final))  # (they did move)
        runs[c] = losses, state
        if c:
            gm = step.graph(state, batches[0])
            copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
            assert copies and all(n.args[0].op == "placeholder" for n in copies)
        if c and kw.get("on_nonfinite") == "skip":
            bad = state._replace(params=dict(state.params, emb=state.params["emb"].clone()))
            bad.params["emb"][0, 0] = float("inf")
            kept = optree.tree_map(torch.clone, (bad.params, bad.opt_state))  # (as passed in)
            after, m = step(bad, batches[0])
            assert int(after.step) == int(state.step) + 1 and int(m["skipped"]) == 1
            assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(kept),
                                                         optree.tree_leaves((after.params, after.opt_state))))
    assert runs["eager"][0] == pytest.approx(runs[False][0], rel=1e-6, abs=1e-6)
    for a, b in zip(optree.tree_leaves(runs["eager"][1]), optree.tree_leaves(runs[False][1])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_donating_graphs_first_run_failing_leaves_the_state_as_it_was(batches):
    # The first run of a graph that writes into its inputs runs on copies of them: when it
    # fails (here as it runs: a token past the vocabulary), the state passed in is whole
    # and the eager step's own error is raised, as for a pure graph.
    bad = {"tokens": batches[0]["tokens"].clone()}
    bad["tokens"][0, 0] = 10**6
    step, params = C.gpt_step("eager", donate=True)
    state = step.init(params)
    kept = optree.tree_map(torch.clone, (state.params, state.opt_state))
    with pytest.raises(IndexError, match="out of bounds"):
        step(state, bad)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(kept),
                                                 optree.tree_leaves((state.params, state.opt_state))))
    state, _ = step(state, batches[0])  # (and it runs on)
    assert step.compiles == 2  # (the failed capture was not kept)


@pytest.mark.multiprocess
def test_two_gloo_ranks_compiled_equal_eager_at_every_zero_stage():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(C.gloo_compiled, 2, 2):
        for stage, runs in res.items():
            # (the graph's collectives over the shared-memory transport, chained in program order)
            assert runs.pop("transports") == {"shm"}, stage
            # (the reductions run in the graph as functional collectives over gloo, in another
            # order than the eager step's bucketed shared-memory ones: equal to rounding)
            C.close(runs[True], runs[False])
            assert runs[True]["compiles"] == 1 and runs[True]["compile_s"][0] > 0, stage


@pytest.mark.multiprocess
def test_four_gloo_ranks_compiled_pipelines_equal_eager():
    # data=2 x pipe=2: the stages' sends and receives are ops of each rank's graph,
    # chained with its shared-memory collectives (ZeRO-3's gathers, the data and pipe sums).
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(C.gloo_pipelines, 4, 4):
        got, eager = r[True], r[False]
        assert got["zb"]["compiles"] == 1 and eager["zb"]["compiles"] == 0  # (one graph, not an eager fallback)
        torch.testing.assert_close(torch.tensor(got["zb"]["losses"]), torch.tensor(eager["zb"]["losses"]),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["zb"]["norms"]), torch.tensor(eager["zb"]["norms"]),
                                   rtol=1e-5, atol=1e-5)
        for a, b in zip(optree.tree_leaves(got["zb"]["params"]), optree.tree_leaves(eager["zb"]["params"])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        f, e = got["fp16"], eager["fp16"]
        assert f["skipped"] == e["skipped"] and f["scales"] == e["scales"], (f["skipped"], e["skipped"])
        assert 0 < e["skipped"][-1] < len(e["skipped"])  # (both kinds of step happened)
        torch.testing.assert_close(torch.tensor(f["losses"]), torch.tensor(e["losses"]), rtol=1e-5, atol=1e-5)
        # (fp16 gradients rounded otherwise by the traced ops' decompositions, through Adam at
        # a learning rate of 1e-2: a gradient near zero can move its weight by up to the
        # learning rate either way; within a tenth of it)
        for a, b in zip(optree.tree_leaves(f["params"]), optree.tree_leaves(e["params"])):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)


@pytest.mark.multiprocess
def test_a_compiled_pipeline_whose_collectives_are_not_on_shared_memory_is_refused():
    from fsharded.testing import run_on_ranks

    for said in run_on_ranks(C.gloo_pipeline_functional, 2, 2):
        assert "pipelined step's other collectives" in said and "compile=False" in said, said


@pytest.mark.multiprocess
def test_two_gloo_ranks_compiled_equal_eager_over_tensor_sequence_and_expert_axes():
    from fsharded.testing import run_on_ranks

    res = run_on_ranks(C.gloo_layouts, 2, 2)
    for name in C.GLOO_LAYOUTS:
        got, eager = res[0][name][True], res[0][name][False]  # (every step's loss, from rank 0's metrics)
        assert len(got["losses"]) == len(eager["losses"]) == 5, name
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5,
                                   msg=name)
        for r in res:
            got, eager = r[name][True], r[name][False]
            assert got["compile_s"] > 0 and eager["compile_s"] == 0, name
            assert got["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-5), name


@pytest.mark.multiprocess
def test_a_traced_permute_is_one_collective_with_the_eager_exchanges_values():
    from fsharded.testing import run_on_ranks

    res = run_on_ranks(C.gloo_traced_permute, 2, 2)
    for rank, r in enumerate(res):
        for name, got in r.items():
            assert torch.equal(got["shm"], got["eager"]) and torch.equal(got["functional"], got["eager"]), (rank, name)
            assert got["shm ops"] == ["fsharded.shm_collective.default"], got["shm ops"]
            assert got["functional ops"] == ["_c10d_functional.all_to_all_single.default",
                                             "_c10d_functional.wait_tensor.default"], got["functional ops"]
        other = torch.arange(6.0).reshape(2, 3) + 10 * (1 - rank)
        assert torch.equal(r["cycle"]["eager"], other)
        # (a position nothing is sent to gets zeros, as JAX's ppermute gives)
        assert torch.equal(r["shift"]["eager"], other if rank == 1 else torch.zeros(2, 3))


@pytest.mark.multiprocess
def test_a_capture_reaching_two_transports_is_traced_again_with_one():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(C.gloo_mixed_transports, 2, 2):
        assert res["calls"] > 1 and res["transports"] == {"functional"}, res["transports"]
        C.close(res["runs"][True], res["runs"][False])


@pytest.mark.multiprocess
def test_a_loss_calling_torch_distributed_itself_is_refused_not_dropped():
    from fsharded.testing import run_on_ranks

    for said in run_on_ranks(C.gloo_eager_collective, 2, 2):
        assert "calls torch.distributed directly" in said and "c10d.allreduce_" in said, said


def test_with_the_optimizer_state_in_a_memory_tier_the_step_says_so_and_runs_eagerly(batches):
    got = {}
    for compile_ in (False, True):
        step, params = C.gpt_step(compile_, mesh={"data": 2}, stage=2, zero_kw=dict(offload_optimizer="cpu"))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got[compile_] = C.train(step, params, batches[:2])
        said = [str(x.message) for x in w if "compile=True" in str(x.message)]
        assert len(said) == int(compile_) and all("memory tier" in m and "runs eagerly" in m for m in said)
        assert step.compiles == 0
    assert got[True]["losses"] == got[False]["losses"]


VIRTUAL = {  # fsharded train's layouts on the virtual mesh (several devices in one process, under vmap)
    "data=2, ZeRO-1": ["--mesh", "data=2", "--set", "zero_stage=1"],
    "data=2, ZeRO-3": ["--mesh", "data=2", "--set", "zero_stage=3"],
    "tensor=2, data=2, ZeRO-2": ["--mesh", "data=2,tensor=2", "--set", "zero_stage=2"],
    "Ulysses, seq=2": ["--mesh", "data=1,seq=2"],
    "ring attention, seq=2": ["--mesh", "data=1,seq=2", "--set", "model.seq_parallel=ring"],
    "experts, expert=2": ["--mesh", "data=1,expert=2", "--set", "model.moe.experts=4"],
    "1F1B pipeline, pipe=2": ["--mesh", "data=1,pipe=2", "--accum", "2"],
}


@pytest.mark.parametrize("layout", list(VIRTUAL))
def test_the_virtual_mesh_compiled_equals_eager(monkeypatch, layout):
    from fsharded import train

    init = _compile.Captured.__init__  # (the captured graph as it is: the capture under vmap is the question)
    monkeypatch.setattr(_compile.Captured, "__init__", lambda self, fn, **kw: init(self, fn, **{**kw, "backend": "eager"}))
    args = ["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "3", "--set", "data=stdlib:200000",
            "--progress", "off", *VIRTUAL[layout]]
    runs = {}
    for compile_ in (False, True):
        cfg = train.make_config(train.build_parser().parse_args(args + (["--compile"] if compile_ else [])))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "runs eagerly"
            runs[compile_] = train.run(cfg, progress="off")
    assert runs[True]["compile_s"] > 0 and runs[False]["compile_s"] == 0
    assert runs[True]["final_loss"] == pytest.approx(runs[False]["final_loss"], abs=1e-5)
    assert runs[True]["val_loss"] == pytest.approx(runs[False]["val_loss"], abs=1e-5)


def test_compile_takes_a_bool_or_a_backend_name():
    with pytest.raises(TypeError, match="compile must be"):
        fs.train_step(gpt.loss, fs.optim.adamw(1e-3), compile=1)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3))
    assert step.compile() is step and step.compiling and step.compile_backend == "inductor"


def test_fsharded_train_compile_trains_the_compiled_step(monkeypatch, capsys, tmp_path):
    from fsharded import train

    # (through the captured graph as it is: Inductor's compile of the step is tested above)
    init = _compile.Captured.__init__
    monkeypatch.setattr(_compile.Captured, "__init__", lambda self, fn, **kw: init(self, fn, **{**kw, "backend": "eager"}))
    args = ["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "3", "--mesh", "data=1",
            "--set", "data=stdlib:200000", "--progress", "off", "--metrics", str(tmp_path / "m.jsonl")]
    def cfg(*extra):
        return train.make_config(train.build_parser().parse_args([*args, *extra]))
    assert cfg("--compile").compile is True and cfg("--set", "compile=true").compile is True
    assert cfg("--no-compile").compile is False and cfg("--set", "compile=false").compile is False
    assert cfg().compile == "auto" and cfg("--set", "compile=auto").compile == "auto"
    with pytest.raises(ValueError, match="compile"):
        cfg("--set", "compile=sometimes")
    eager = train.run(cfg(), progress="off")  # (auto: 3 steps run eagerly)
    capsys.readouterr()
    got = train.run(train.make_config(train.build_parser().parse_args([*args, "--compile"])), progress="off")
    out = capsys.readouterr().out
    assert ", compiled" in out and "compiled in " in out and got["compile_s"] > 0 and eager["compile_s"] == 0
    assert got["final_loss"] == pytest.approx(eager["final_loss"], abs=1e-5)
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert recs[0]["compile_s"] > 0 and [r["compile_s"] for r in recs[1:]] == [0.0, 0.0]


def test_fsharded_train_compiles_by_default_where_it_applies_and_pays(monkeypatch, capsys):
    from fsharded import train
    from fsharded.tools import _train_loop as L

    init = _compile.Captured.__init__
    monkeypatch.setattr(_compile.Captured, "__init__", lambda self, fn, **kw: init(self, fn, **{**kw, "backend": "eager"}))
    args = ["--preset", "tiny", "--seq-len", "16", "--batch", "1", "--mesh", "data=1", "--set", "model.n_layers=1",
            "--set", "data=stdlib:100000", "--progress", "off", "--set", "log_every=1000"]

    def cfg(*extra):
        return train.make_config(train.build_parser().parse_args([*args, *extra]))
    n = L.AUTO_MIN_STEPS
    real = L.inductor_missing
    monkeypatch.setattr(L, "inductor_missing", lambda: None)  # (Inductor can generate code)
    assert L.decide(cfg("--steps", str(n)), n) == (True, "")
    assert not L.decide(cfg("--steps", str(n - 1)), n - 1)[0]
    assert not L.decide(cfg("--steps", str(n), "--no-compile"), n)[0]
    assert L.decide(cfg("--steps", "3", "--compile"), 3) == (True, "")
    assert not L.decide(cfg("--steps", str(n), "--set", "zero_stage=1", "--set", "offload.optimizer=cpu"), n)[0]
    monkeypatch.setattr(L, "inductor_missing", lambda: "no C++ compiler for Inductor (test)")
    assert L.decide(cfg("--steps", str(n)), n) == (False, "no C++ compiler for Inductor (test)")
    monkeypatch.setattr(L, "inductor_missing", real)
    got = train.run(cfg("--steps", str(n)), progress="off")  # the default: auto
    out = capsys.readouterr().out
    assert ", compiled" in out and got["compile_s"] > 0 and got["steps"] == n
    # (a job of 200 steps run eagerly under auto says why, as a resumed one near its end does)
    monkeypatch.setattr(L, "inductor_missing", lambda: "no C++ compiler for Inductor (test)")
    got = train.run(cfg("--steps", str(n)), progress="off")
    assert ", eager (no C++ compiler for Inductor (test))" in capsys.readouterr().out and got["compile_s"] == 0


def test_under_compile_auto_a_capture_not_built_runs_the_job_eagerly(capsys):
    from fsharded.tools import _train_loop as L

    class Step:  # (a step whose capture is not built for its layout)
        compiling = True

        def __call__(self, state, batch):
            if self.compiling:
                raise NotImplementedError("train_step(compile=True): this layout is not built")
            return state + 1, {}

        def eager(self):
            self.compiling = False
    assert L.call(Step(), 1, None, auto=True, main_rank=True) == (2, {})
    assert "compile=auto: running eagerly (train_step(compile=True): this layout is not built)" in capsys.readouterr().out
    with pytest.raises(NotImplementedError):
        L.call(Step(), 1, None, auto=False, main_rank=True)
    with pytest.raises(NotImplementedError):  # (on real ranks a rank cannot fall back alone)
        L.call(Step(), 1, None, auto=True, main_rank=True, distributed=True)

    class Broken(Step):  # (a toolchain that fails to compile)
        def __call__(self, state, batch):
            if self.compiling:
                raise RuntimeError("train_step(compile=True): capturing or compiling the step failed, although "
                                   "it runs eagerly (CalledProcessError: ...). Pass compile=False")
            return state + 1, {}
    assert L.call(Broken(), 1, None, auto=True, main_rank=False) == (2, {})

    class Wrong(Step):  # (the step's own error, eager as compiled: not a capture failure)
        def __call__(self, state, batch):
            raise RuntimeError("train_step: the loss is nan")
    with pytest.raises(RuntimeError, match="the loss is nan"):
        L.call(Wrong(), 1, None, auto=True, main_rank=True)


def test_eager_undoes_compile(batches):
    step, params = C.gpt_step("eager")
    state = step.init(params)
    state, _ = step(state, batches[0])
    assert step.compiles == 1
    assert step.eager() is step and not step.compiling and step.compiles == 0  # (its graphs dropped)
    got, m = step(state, batches[1])
    assert "compile_s" not in m and step.compiles == 0
    ref, _ = C.gpt_step(False)
    ref_state = ref.init(params)
    for b in batches[:2]:
        ref_state, _ = ref(ref_state, b)
    for a, b in zip(optree.tree_leaves(step.params(got)), optree.tree_leaves(ref.params(ref_state))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_loss_reading_a_value_on_the_host_is_refused_not_baked_in():
    # float(...) of a traced value would turn into a constant of the graph: the capture
    # refuses it (the eager step runs, so the error says the capture failed).
    def loss(p, b):
        scale = float(b["x"].abs().max())  # a host read of this batch's value
        return ((b["x"] @ p["w"]) ** 2).mean() / scale

    step = fs.train_step(loss, fs.optim.sgd(0.1), compile="eager")
    state = step.init({"w": torch.ones(3, 2)})
    with pytest.raises(RuntimeError, match=r"capturing or compiling the step failed, although it runs eagerly"):
        step(state, {"x": torch.ones(4, 3)})
    assert step.compiles == 0
    eager = fs.train_step(loss, fs.optim.sgd(0.1))
    eager(eager.init({"w": torch.ones(3, 2)}), {"x": torch.ones(4, 3)})  # (it does run eagerly)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_manifest_of_a_compiled_step_is_the_eager_ones(batches, stage):
    got = {}
    for compile_ in (False, True):
        step, params = C.gpt_step(compile_, mesh={"data": 2}, stage=stage, blocks="blocks" if stage == 3 else None)
        man = step.collectives(step.init(params), batches[0])
        got[compile_] = [(e.op, e.axis, e.shape, e.bytes_sent) for e in man]
    assert got[True] == got[False] and got[True]
