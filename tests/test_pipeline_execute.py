"""The pipeline executor: a GPT cut into stages, run by every schedule, gives the loss and
the gradients of the uncut model, in one process (the ranks interleaved over a mailbox)
and on gloo ranks (point-to-point sends), with no more live activations per rank than
the table's bound."""

from __future__ import annotations

import dataclasses

import optree
import pipeline_cases as C
import pytest
import torch

from fsharded.models import gpt, gpt_stages
from fsharded.parallel import pipeline as pp
from fsharded.testing import run_on_ranks

GRID = [("gpipe", 2, 1), ("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2),
        ("zb", 2, 1), ("zb", 4, 1)]


def reference(params, tokens, **kw):
    p = C.leaves_requiring_grad(params)
    loss = gpt.loss(p, {"tokens": tokens}, attention="einsum", **kw)
    return loss.detach(), torch.autograd.grad(loss, optree.tree_leaves(p))


def assert_matches(stages, grads_by_stage, loss, params, tokens):
    ref_loss, ref_grads = reference(params, tokens)
    got = stages.merge(grads_by_stage, params)
    assert optree.tree_structure(got) == optree.tree_structure(params)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    for path, a, b in zip(optree.tree_paths(got), optree.tree_leaves(got), ref_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (path, float((a - b).abs().max()))


# -- cutting ----------------------------------------------------------------------------------

def test_cut_balances_by_size_and_takes_boundaries():
    assert pp.cut([1] * 8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert pp.cut([5, 1, 1, 1, 1, 1], 2) == (range(0, 1), range(1, 6))
    # the embeddings on the first stage and the head on the last weigh in
    assert pp.cut([1] * 6, 2, first=2) == (range(0, 2), range(2, 6))
    assert pp.cut([1] * 6, 2, last=2) == (range(0, 4), range(4, 6))
    assert pp.cut([1] * 5, 3, boundaries=[1, 4]) == (range(0, 1), range(1, 4), range(4, 5))
    for sizes in ([3, 1, 4, 1, 5, 9, 2, 6], [1] * 7, [10, 1, 1, 10]):
        for k in range(1, len(sizes) + 1):
            r = pp.cut(sizes, k)
            assert [i for x in r for i in x] == list(range(len(sizes))) and all(len(x) for x in r)
            # no cut has a smaller largest stage (brute force over all cuts)
            import itertools
            best = min(max(sum(sizes[a:b]) for a, b in zip((0, *c), (*c, len(sizes))))
                       for c in itertools.combinations(range(1, len(sizes)), k - 1))
            assert max(sum(sizes[i] for i in x) for x in r) == best


def test_cut_refuses_what_cannot_be_cut():
    with pytest.raises(ValueError, match="4 pipeline stages .* 3 blocks.*at most 3"):
        pp.cut([1, 1, 1], 4)
    with pytest.raises(ValueError, match="give 1 increasing block indices"):
        pp.cut([1, 1, 1], 2, boundaries=[0])
    with pytest.raises(ValueError, match="give 2 increasing"):
        pp.cut([1, 1, 1, 1], 3, boundaries=[2, 2])


def test_gpt_stages_hold_the_embeddings_first_and_the_head_last():
    params, _ = C.setup()
    st = gpt_stages.pipeline_stages(params, 2)
    assert st.ranges == (range(0, 2), range(2, 4))
    assert set(st.params_of(params, 0)) == {"emb", "pos", "blocks"}
    assert set(st.params_of(params, 1)) == {"final_norm", "emb", "blocks"}  # tied: both ends
    untied, _ = C.setup(tied_embeddings=False)
    assert set(gpt_stages.pipeline_stages(untied, 2).params_of(untied, 1)) == {"final_norm", "head", "blocks"}
    with pytest.raises(ValueError, match="5 pipeline stages .* 4 blocks"):
        gpt_stages.pipeline_stages(params, 5)
    with pytest.raises(ValueError, match="mixture-of-experts blocks; pass its routing config"):
        gpt_stages.pipeline_stages(gpt.init(gpt.GPTConfig.tiny(moe={"experts": 2})), 2)


# -- in one process --------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,v", GRID)
def test_every_schedule_gives_the_uncut_models_loss_and_gradients(name, p, v):
    params, tokens = C.setup()
    m = 4
    sched = pp.make(name, p, m, v)
    st = gpt_stages.pipeline_stages(params, p * v, attention="einsum")
    parts = {s: C.leaves_requiring_grad(st.params_of(params, s)) for s in range(st.n)}
    res = pp.run(sched, st, parts, C.micro_batches(tokens, m))
    assert_matches(st, res.grads, res.loss, params, tokens)
    # never more micro-batches held per rank than the table allows
    bound = pp.check(sched).peak_activations
    assert all(res.peak_held[r] <= bound[r] for r in range(p)), (res.peak_held, bound)
    if name in ("1f1b", "zb"):
        assert [res.peak_held[r] for r in range(p)] == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("name,p,v", [("1f1b", 2, 1), ("zb", 2, 1), ("interleaved", 2, 2)])
def test_functional_differentiation_inside_vmap_gives_each_shards_gradients(name, p, v):
    # How the virtual mesh runs it: torch.func.vjp per stage, inside a vmap over data shards.
    params, tokens = C.setup()
    m = 2
    st = gpt_stages.pipeline_stages(params, p * v, attention="einsum")

    def body(tok):
        res = pp.run(pp.make(name, p, m, v), st, {s: st.params_of(params, s) for s in range(st.n)},
                     C.micro_batches(tok, m), functional=True)
        return res.loss, st.merge(res.grads, params)

    loss, grads = torch.func.vmap(body)(tokens.reshape(2, 4, -1))
    for d in range(2):
        ref_loss, ref_grads = reference(params, tokens[4 * d:4 * (d + 1)])
        assert abs(float(loss[d]) - float(ref_loss)) < 1e-5
        for a, b in zip(optree.tree_leaves(grads), ref_grads):
            assert torch.allclose(a[d], b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("positions,tied", [("rotary", False), ("learned", False)])
def test_untied_heads_and_rotary_positions(positions, tied):
    params, tokens = C.setup(positions=positions, tied_embeddings=tied)
    sched = pp.one_f_one_b(2, 2)
    st = gpt_stages.pipeline_stages(params, 2, attention="einsum")
    parts = {s: C.leaves_requiring_grad(st.params_of(params, s)) for s in range(2)}
    res = pp.run(sched, st, parts, C.micro_batches(tokens, 2))
    assert_matches(st, res.grads, res.loss, params, tokens)


def test_a_schedule_for_other_sizes_is_refused():
    params, tokens = C.setup()
    st = gpt_stages.pipeline_stages(params, 2)
    parts = {s: st.params_of(params, s) for s in range(2)}
    with pytest.raises(ValueError, match="4 stages .* cut into 2"):
        pp.run(pp.one_f_one_b(4, 2), st, parts, C.micro_batches(tokens, 2))
    with pytest.raises(ValueError, match="runs 4 micro-batches, got 2"):
        pp.run(pp.one_f_one_b(2, 4), st, parts, C.micro_batches(tokens, 2))


def test_a_table_that_cannot_run_is_refused_before_any_action_runs():
    from fsharded.parallel.pipeline._table import Action, with_comms
    order = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 0, 1), Action("F", 0, 1)]]
    bad = with_comms("bad", 2, 1, 1, order)
    params, tokens = C.setup()
    st = gpt_stages.pipeline_stages(params, 2)
    parts = {s: C.leaves_requiring_grad(st.params_of(params, s)) for s in range(2)}
    ran = []
    st_spy = dataclasses.replace(st, first=lambda p, b: ran.append(1) or st.first(p, b))
    with pytest.raises(pp.ScheduleError, match="rank 1.*B0"):
        pp.run(bad, st_spy, parts, C.micro_batches(tokens, 1))
    assert ran == []


# -- on gloo ranks ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,v", [("1f1b", 2, 1), ("zb", 2, 1), ("interleaved", 2, 2), ("1f1b", 4, 1),
                                      ("zb", 4, 1)])
def test_on_gloo_ranks_point_to_point_gives_the_same_numbers(name, p, v):
    params, tokens = C.setup()
    m = 4
    out = run_on_ranks(C.run_rank, p, name, p, v, m)
    st = gpt_stages.pipeline_stages(params, p * v, attention="einsum")
    grads = {s: g for r in out for s, g in r["grads"].items()}
    assert sorted(grads) == list(range(p * v))
    last = [r["loss"] for r in out if r["loss"] is not None]
    assert len(last) == 1
    assert_matches(st, grads, last[0], params, tokens)
    # the same numbers as the one-process run (the same actions in the same order; the ranks'
    # torch threads may sum a matmul in another order)
    parts = {s: C.leaves_requiring_grad(st.params_of(params, s)) for s in range(st.n)}
    local = pp.run(pp.make(name, p, m, v), st, parts, C.micro_batches(tokens, m))
    for s in range(st.n):
        for a, b in zip(optree.tree_leaves(grads[s]), optree.tree_leaves(local.grads[s])):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    assert [r["peak"] for r in out] == [local.peak_held[r] for r in range(p)]


@pytest.mark.parametrize("name,p,m", [("gpipe", 2, 4), ("1f1b", 2, 4), ("zb", 2, 4), ("1f1b", 4, 8), ("zb", 4, 8)])
def test_the_memory_tracker_sees_no_more_live_activations_per_rank_than_the_tables_bound(name, p, m):
    # One micro-batch's activations per rank (its stage's forward held to its backward),
    # then the schedule: the tracker's peak of live activations on each rank is at most
    # the table's bound of held micro-batches times that, and more than one fewer of them
    # (it holds as many as the table says). The allowance: the receive posted ahead (the
    # next micro-batch's input) and the small headers of the first sends.
    one = run_on_ranks(C.tracked_rank, p, "gpipe", p, 1)
    got = run_on_ranks(C.tracked_rank, p, name, p, m)
    bound = pp.check(pp.make(name, p, m)).peak_activations
    cfg = gpt.GPTConfig.tiny(n_layers=4)
    flight = 2 * cfg.seq_len * cfg.d_model * 4 + 256  # a 2-row micro-batch's input, fp32
    for r in range(p):
        a1, peak = one[r]["activations"], got[r]["activations"]
        assert got[r]["held"] == bound[r]
        assert peak <= bound[r] * a1 + flight, (r, peak, bound[r], a1)
        assert peak > (bound[r] - 1) * a1, (r, peak, bound[r], a1)
    if name != "gpipe":  # 1F1B's bound is p - r, not m
        assert got[0]["activations"] < (bound[0] + 1) * one[0]["activations"] < m * one[0]["activations"]


def test_untied_head_on_gloo_ranks():
    params, tokens = C.setup(tied_embeddings=False)
    out = run_on_ranks(C.run_rank, 2, "1f1b", 2, 1, 2, True)
    st = gpt_stages.pipeline_stages(params, 2, attention="einsum")
    grads = {s: g for r in out for s, g in r["grads"].items()}
    loss = next(r["loss"] for r in out if r["loss"] is not None)
    assert_matches(st, grads, loss, params, tokens)


# -- the weight gradients a split backward puts off -------------------------------------------

class _CountProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products run (mm, bmm, addmm)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _split(form: str, fn, leaves: list, x: torch.Tensor | None):
    """``fn(leaves, x) -> y`` run with its backward split, as the executor runs it: the
    gradients ``I`` gives (input's, leaves'), the sink, and the products ``I`` ran."""
    from fsharded.parallel.pipeline._deferred import Deferred, Deferring
    from fsharded.parallel.pipeline._execute import Autograd
    sink = Deferred()
    if form == "mode":  # inside torch.func's transforms: the forward under Deferring
        xs = [] if x is None else [x]
        with Deferring(leaves, sink):
            y = fn(leaves, x)
        with _CountProducts() as count:
            got = list(torch.autograd.grad(y, xs + leaves, allow_unused=True))
        return (got[0] if x is not None else None), got[len(xs):], sink, count.n
    y, back = Autograd().forward(lambda p, xx: (fn(p, xx), ()), leaves, x, sink=sink)
    with _CountProducts() as count:
        gp, gx = back(None)
    return gx, gp, sink, count.n


@pytest.mark.parametrize("form", ["mode", "graph"])
def test_a_split_backward_puts_the_weight_products_off_and_computes_them_in_w(form):
    """Both forms: a Python autograd node per product, made under a mode during the
    forward (torch.func's transforms, the virtual mesh), and the products read off the
    graph after a plain forward (plain autograd, real ranks): the same put-off
    products, whose weight side I does not run, and the same gradients."""
    params, tokens = C.setup(tied_embeddings=False)
    st = gpt_stages.pipeline_stages(params, 2, attention="einsum")
    part = C.leaves_requiring_grad(st.params_of(params, 1))
    leaves, tdef = optree.tree_flatten(part)
    x = torch.randn(4, 16, params["emb"].shape[1], requires_grad=True)
    batch = {"tokens": tokens[:4]}

    def fn(ls, xx):
        return st.forward(1, optree.tree_unflatten(tdef, ls), xx, batch)

    y = fn(leaves, x)
    with _CountProducts() as count:
        ref = torch.autograd.grad(y, [x] + leaves)
    whole = count.n  # the products of one unsplit backward
    gx, grads, sink, in_i = _split(form, fn, leaves, x)
    paths = optree.tree_paths(part)
    put_off = [paths[k] for k, *_ in sink.parts]
    # every projection of the blocks and the head (each once): the products with a parameter
    assert sorted(put_off) == sorted(p for p in paths if p[-1] in ("wq", "wk", "wv", "wo", "w_in", "w_out", "head"))
    assert all(grads[k] is None for k, *_ in sink.parts)
    assert in_i == whole - len(put_off)  # I runs each put-off product's activation side only
    assert torch.allclose(gx, ref[0], atol=1e-6)  # the input's gradient is whole after I
    sink.apply(grads)
    assert sink.parts == []
    for path, a, b in zip(paths, grads, ref[1:]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), path


@pytest.mark.parametrize("eq,ok", [("btd,dhe->bthe", True), ("bthe,hed->btd", True), ("...k,kn->...n", True),
                                   ("d,dn->n", True), ("bd,dhe->bhe", True),
                                   ("...k,nk->...n", True),
                                   ("bij,bjk->bik", True), ("ii,ij->j", False), ("ij,jk->i", False),
                                   ("ij,kl->ijkl", True), ("ij,j", False)])
def test_the_put_off_products_are_the_contractions_the_rule_covers(eq, ok):
    from fsharded.parallel.pipeline._deferred import Deferred, _equations, _Product
    assert (_equations(eq) is not None) == ok
    if not ok:
        return
    a, b = eq.split("->")[0].split(",")
    sizes = dict(zip("bdhetijkln", (2, 3, 4, 5, 6, 2, 3, 4, 5, 3)))
    shape = lambda s: [sizes[c] for c in s.replace("...", "b")]  # noqa: E731
    x = torch.randn(shape(a), requires_grad=True)
    w = torch.randn(shape(b), requires_grad=True)
    ref = torch.autograd.grad(torch.einsum(eq, x, w).square().sum(), [x, w])
    sink = Deferred()
    y = _Product.apply(x, w, eq, sink, 0)
    (dx,) = torch.autograd.grad(y.square().sum(), [x])
    grads = [None]
    sink.apply(grads)
    assert torch.allclose(dx, ref[0], atol=1e-5) and torch.allclose(grads[0], ref[1], atol=1e-5)


@pytest.mark.parametrize("form", ["mode", "graph"])
def test_linear_and_matmul_of_a_parameter_are_put_off_too(form):
    """F.linear with a bias (addmm), matmuls of a 3-d activation (mm) and of a transposed
    parameter; in the graph form a parameter used twice (w1) is not put off."""
    w1, w2, w3, b = (torch.randn(8, 6, requires_grad=True), torch.randn(6, 5, requires_grad=True),
                     torch.randn(7, 5, requires_grad=True), torch.randn(8, requires_grad=True))
    x = torch.randn(2, 3, 4, 6, requires_grad=True)

    def f(ls, x):
        w1, w2, w3, b = ls
        h = torch.nn.functional.linear(x[0], w1, b).relu() @ w1
        return ((h @ w2) @ w3.t()).sum() + torch.nn.functional.linear(x[1, 0], w1, b).square().sum()

    leaves = [w1, w2, w3, b]
    ref = torch.autograd.grad(f(leaves, x), [x] + leaves)
    gx, grads, sink, _ = _split(form, f, leaves, x)
    expect = [0, 0, 0, 1] if form == "mode" else [1, 2]  # (the mode: a product with a leaf itself)
    assert sorted(k for k, *_ in sink.parts) == expect
    assert all(grads[k] is None for k in expect)
    sink.apply(grads)
    for a, r in zip([gx, *grads], ref):
        assert torch.allclose(a, r, atol=1e-5)


def test_a_product_with_a_constant_input_is_put_off():
    """The first stage's case: the activation side needs no gradient (data), the put-off
    product's other operand is that constant, saved by the node."""
    w1, w2 = torch.randn(6, 5, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    data = torch.randn(3, 6)

    def f(ls, _):
        return ((data @ ls[0]).tanh() @ ls[1]).sum()

    ref = torch.autograd.grad(f([w1, w2], None), [w1, w2])
    gx, grads, sink, _ = _split("graph", f, [w1, w2], None)
    assert gx is None and grads == [None, None] and sorted(k for k, *_ in sink.parts) == [0, 1]
    sink.apply(grads)
    for a, r in zip(grads, ref):
        assert torch.allclose(a, r, atol=1e-5)


def test_what_the_graph_form_does_not_put_off_keeps_its_whole_gradient():
    """Complex products (autograd's gradient takes the conjugate), a parameter that is
    itself an output of the stage or reached through a view that is one (their seeds
    arrive directly), a parameter with a gradient hook of its own (W runs no hooks): each
    keeps its gradient in I, equal to the unsplit backward's."""
    x = torch.randn(4, 3)
    wc = torch.randn(3, 2, dtype=torch.complex64, requires_grad=True)
    xc = torch.randn(4, 3, dtype=torch.complex64)
    cases = {
        "complex": ([wc], lambda p, _: (xc @ p[0]).abs().square().sum()),
        "leaf as output": ([torch.randn(3, 5, requires_grad=True)], lambda p, _: ((x @ p[0]).sum(), p[0].sum())),
        "view as output": ([torch.randn(1, 3, 5, requires_grad=True)],
                           lambda p, _: ((x @ p[0].squeeze(0)).sum(), p[0].squeeze(0).square().sum())),
        "hooked": ([torch.randn(3, 5, requires_grad=True)],
                   lambda p, _: (p[0].register_hook(lambda g: 3 * g), (x @ p[0]).square().sum())[1]),
    }
    from fsharded.parallel.pipeline._deferred import Deferred
    from fsharded.parallel.pipeline._execute import Autograd
    for name, (leaves, f) in cases.items():
        ls = [t.detach().requires_grad_() for t in leaves]
        out = f(ls, None)
        ref = torch.autograd.grad(sum(out) if isinstance(out, tuple) else out, ls)
        sink = Deferred()

        def fn(p, xx, f=f):
            o = f(p, xx)
            return (o if not isinstance(o, tuple) else o), ()
        y, back = Autograd().forward(fn, leaves, None, sink=sink)
        gp, _ = back(None if not isinstance(y, tuple) else None)
        assert sink.parts == [], name
        assert torch.allclose(gp[0], ref[0], atol=1e-5), name


def test_an_operand_changed_in_place_before_w_is_refused():
    from fsharded.parallel.pipeline._deferred import Deferred
    from fsharded.parallel.pipeline._execute import Autograd
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5)
    sink = Deferred()
    y, back = Autograd().forward(lambda p, xx: ((xx.tanh() @ p[0]).sum(), ()), [w], x, sink=sink)
    back(None)
    assert len(sink.parts) == 1
    sink.parts[0][1].other.add_(1.0)  # the saved tanh(x), written after I
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        sink.apply([None])


def test_a_kept_point_to_point_learns_shapes_per_micro_batch_shape():
    out = run_on_ranks(C.p2p_shapes, 2)
    for r in out:
        assert r[8] < 1e-6 and r[4] < 1e-6
    assert "act of stage 0 is torch.float32 (3, 3) this time" in out[0]["error"]
    assert out[1]["error"] is None


def test_the_measured_timeline_is_drawn_below_the_planned_one(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from fsharded.plot import pipeline_figure

    params, tokens = C.setup()
    sched = pp.zero_bubble(2, 4)
    st = gpt_stages.pipeline_stages(params, 2, attention="einsum")
    res = pp.run(sched, st, {s: st.params_of(params, s) for s in range(2)}, C.micro_batches(tokens, 4))
    # every action has its span, in order, on the rank that ran it
    for r in range(2):
        assert [a for _, _, a in res.spans[r]] == list(sched.actions[r])
        assert all(b <= e for b, e, _ in res.spans[r])
        assert all(e0 <= b1 for (_, e0, _), (b1, _, _) in zip(res.spans[r], res.spans[r][1:]))
    fig = pipeline_figure(sched, measured=res)
    planned, ran = fig.axes
    compute = [(r, a) for r in range(2) for a in sched.actions[r] if a.kind in "FBIW"]
    assert len(planned.patches) == len(ran.patches) == len(compute)
    assert "measured: idle" in ran.get_title() and "bubble" in planned.get_title()
    fig.savefig(tmp_path / "zb.png")
    with pytest.raises(ValueError, match="leave ax= out"):
        pipeline_figure(sched, ax=planned, measured=res)


@pytest.mark.parametrize("name,p,v", [("1f1b", 2, 1), ("zb", 2, 1), ("interleaved", 2, 2), ("gpipe", 4, 1)])
def test_weight_actions_gather_at_their_action_and_transpose_at_their_release(name, p, v):
    """``run(weights=)`` on a table with weight actions: each stage's weights come from
    ``weights`` at its GATHER (here stored halved, gathered doubled: the transpose doubles
    the gradients), are used until its RELEASE, and its gradients are the transposes':
    those of the uncut model, halved-stored params' gradients doubled. A gather in flight
    (an object with ``wait()``) is waited for at its stage's first use."""
    params, tokens = C.setup()
    m = 4
    sched = pp.with_gathers(pp.make(name, p, m, v))
    st = gpt_stages.pipeline_stages(params, p * v, attention="einsum")
    stored = {s: optree.tree_map(lambda t: t / 2, st.params_of(params, s)) for s in range(st.n)}
    calls, waited, live = [], [], set()

    class Arriving:
        def __init__(self, whole):
            self.whole = whole

        def wait(self):
            waited.append(1)
            return self.whole

    def weights(s, kept):
        calls.append(("gather", s))
        assert s not in live  # gathered once
        live.add(s)
        whole = optree.tree_map(lambda t: 2 * t, kept)

        def transpose(grads):
            calls.append(("release", s))
            live.discard(s)
            return [None if g is None else 2 * g for g in grads]
        return (Arriving(whole) if s % 2 else whole), transpose

    res = pp.run(sched, st, stored, C.micro_batches(tokens, m), weights=weights)
    ref_loss, ref_grads = reference(params, tokens)
    got = st.merge(res.grads, params)
    assert abs(float(res.loss) - float(ref_loss)) < 1e-5
    for path, a, b in zip(optree.tree_paths(got), optree.tree_leaves(got), ref_grads):
        assert torch.allclose(a, 2 * b, atol=1e-5, rtol=1e-4), path
    kinds = [a.kind for row in sched.actions for a in row]
    assert [c for c, _ in calls].count("gather") == kinds.count("GATHER")
    assert [c for c, _ in calls].count("release") == kinds.count("RELEASE") and not live
    assert waited and len(waited) == sum(1 for c, s in calls if c == "gather" and s % 2)
    with pytest.raises(ValueError, match="has none: make it with with_gathers"):
        pp.run(pp.make(name, p, m, v), st, stored, C.micro_batches(tokens, m), weights=weights)
