"""Mixture of experts (fsharded/parallel/moe.py): the layer against a loop over experts
(forward, gradients, the dropped choices), capacity edge cases, the balancing losses and
bias balancing, expert parallelism on the virtual mesh against the layer per shard, the
all_to_all bytes, tracing with make_fx, and the errors."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fsharded as fs
from fsharded import P
from fsharded.parallel import moe

D, FF, T = 16, 32, 32


def _params(E: int, seed: int = 0, router_std: float = 1.0) -> dict:
    """MoE parameters with a peaked router (so capacity binds) and nonzero biases."""
    p = moe.init(D, FF, E, seed=seed, bias=True, std=0.3)
    g = torch.Generator().manual_seed(seed + 1)
    p["router"] = torch.randn(D, E, generator=g) * router_std / math.sqrt(D) * 4
    p["b1"] = torch.randn(E, FF, generator=g) * 0.1
    p["b2"] = torch.randn(E, D, generator=g) * 0.1
    return p


def _tokens(n: int = T, seed: int = 5) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def reference(params: dict, x: torch.Tensor, *, top_k: int, capacity_factor: float | None,
              min_capacity: int = 4, normalize: bool | None = None) -> tuple[torch.Tensor, set]:
    """The layer as a Python loop: each token's choices ranked by probability, slots handed
    out to first choices in token order, then second choices, ...; each kept choice adds its
    expert's MLP output times its weight. Returns y and the dropped (token, choice) pairs."""
    n, E = x.shape[0], params["router"].shape[1]
    normalize = top_k > 1 if normalize is None else normalize
    probs = torch.softmax(x @ params["router"], dim=-1)
    C = n if capacity_factor is None else min(n, max(min_capacity, math.ceil(top_k * n * capacity_factor / E)))
    choices = [sorted(range(E), key=lambda e, t=t: -float(probs[t, e].detach()))[:top_k] for t in range(n)]
    used, dropped = [0] * E, set()
    for j in range(top_k):
        for t in range(n):
            e = choices[t][j]
            if used[e] < C:
                used[e] += 1
            else:
                dropped.add((t, j))
    rows = []
    for t in range(n):
        total = sum(probs[t, e] for e in choices[t]) if normalize else 1.0
        y = torch.zeros(D)
        for j, e in enumerate(choices[t]):
            if (t, j) in dropped:
                continue
            h = F.gelu(x[t] @ params["w1"][e] + params["b1"][e]) @ params["w2"][e] + params["b2"][e]
            y = y + probs[t, e] / total * h
        rows.append(y)
    return torch.stack(rows), dropped


def _grads(fn, params: dict, x: torch.Tensor, cot: torch.Tensor):
    return torch.func.grad(lambda p, x: (fn(p, x) * cot).sum(), argnums=(0, 1))(params, x)


def _assert_trees_close(a, b, **tol) -> None:
    for u, v in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True):
        torch.testing.assert_close(u, v, **tol)


SINGLE = [  # top_k, experts, capacity_factor, normalize, method
    (1, 4, 1.0, None, "capacity"),  # Switch
    (2, 4, 0.75, None, "capacity"),  # GShard
    (3, 8, 0.75, True, "capacity"),
    (3, 8, 0.75, False, "capacity"),
    (2, 8, None, None, "capacity"),  # dropless, padded buffer
    (2, 8, None, None, "sorted"),  # dropless, sorted by expert
]


@pytest.mark.parametrize("top_k,E,cf,normalize,method", SINGLE)
def test_layer_equals_a_loop_over_experts(top_k, E, cf, normalize, method):
    params, x = _params(E), _tokens()
    cot = torch.randn(T, D, generator=torch.Generator().manual_seed(9))
    kw = dict(top_k=top_k, capacity_factor=cf, normalize=normalize)
    y, aux = moe.moe_layer(params, x, method=method, **kw)
    want, dropped = reference(params, x, **kw)
    # fp32, the same products summed in a different order: a few ulps
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    r = moe.route(x @ params["router"], **kw)
    assert {(t, j) for t, j in torch.nonzero(~r.kept).tolist()} == dropped
    assert (len(dropped) > 0) == (cf is not None)  # the capacity cases do drop
    assert float(aux["drop_fraction"]) == pytest.approx(len(dropped) / (T * top_k))
    assert aux["load"].sum() == T * top_k
    g = _grads(lambda p, x: moe.moe_layer(p, x, method=method, **kw)[0], params, x, cot)
    g_ref = _grads(lambda p, x: reference(p, x, **kw)[0], params, x, cot)
    # the weight gradients sum up to T per-token products in another order: 1e-5
    _assert_trees_close(g, g_ref, rtol=1e-5, atol=1e-5)
    assert g[0]["router"].abs().sum() > 0  # through the combine weights


@pytest.mark.parametrize("bias", [False, True])
def test_expert_mlp_looped_and_batched_forms_agree(bias):
    # CPU runs the experts one mm at a time, other devices one bmm for all: the same
    # values and gradients (the batched form checked here on CPU tensors).
    g = torch.Generator().manual_seed(3)
    E, C, d, f = 3, 5, 8, 16
    params = {"w1": torch.randn(E, d, f, generator=g), "w2": torch.randn(E, f, d, generator=g)}
    if bias:
        params.update(b1=torch.randn(E, f, generator=g), b2=torch.randn(E, d, generator=g))
    h, cot = torch.randn(E, C, d, generator=g), torch.randn(E, C, d, generator=g)
    outs = []
    for form in (moe._experts_looped, moe._experts_batched):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        hh = h.clone().requires_grad_()
        y = form(p, hh)
        y.backward(cot)
        outs.append((y.detach(), hh.grad, {k: v.grad for k, v in p.items()}))
    for e in range(E):  # each expert's MLP, written out
        a = h[e] @ params["w1"][e] + (params["b1"][e] if bias else 0)
        want = torch.nn.functional.gelu(a) @ params["w2"][e] + (params["b2"][e] if bias else 0)
        torch.testing.assert_close(outs[0][0][e], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(moe.expert_mlp(params, h), outs[0][0])  # CPU takes the looped form
    # Under torch.func (the virtual mesh) the looped form is plain ops on unbound experts;
    # eagerly it is one Function writing the weight gradients in place: the same numbers.
    loss = lambda p, hh: (moe._experts_looped(p, hh) * cot).sum()  # noqa: E731
    gp, gh = torch.func.grad(loss, argnums=(0, 1))(params, h)
    torch.testing.assert_close((gh, gp), (outs[0][1], outs[0][2]), rtol=1e-5, atol=1e-5)
    # Two groups of rows per expert (expert parallelism's shard-major rows): both add up.
    h2, cot2 = torch.cat([h, h.flip(1)]), torch.cat([cot, cot.flip(0)])
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    (moe._experts_looped(p, h2) * cot2).sum().backward()
    gp = torch.func.grad(lambda p: (moe._experts_looped(p, h2) * cot2).sum())(params)
    torch.testing.assert_close({k: v.grad for k, v in p.items()}, gp, rtol=1e-5, atol=1e-5)


def test_sorted_form_fills_the_same_buffer():
    params, x = _params(8), _tokens()
    r = moe.route(x @ params["router"], top_k=2, capacity_factor=None)
    torch.testing.assert_close(moe.sorted_dispatch(x, r), moe.dispatch(x, r), rtol=0, atol=0)
    order, counts, offsets = moe.sort_by_expert(r)
    ids = r.experts.t().reshape(-1)[order]
    assert torch.equal(ids, ids.sort().values) and counts.sum() == 2 * T
    assert torch.equal(offsets, torch.cumsum(counts, 0) - counts)


def _skewed(E: int = 4) -> tuple[dict, torch.Tensor]:
    """Every token's logits are (10, 5, 0, ...): first choice expert 0, second expert 1."""
    params = _params(E)
    params["router"] = torch.zeros(D, E)
    params["router"][0, :2] = torch.tensor([10.0, 5.0])
    x = _tokens()
    x[:, 0] = 1.0
    return params, x


def test_capacity_formula_and_a_skewed_router():
    assert moe.capacity(32, 4, top_k=1, capacity_factor=1.0) == 8
    assert moe.capacity(32, 4, top_k=2, capacity_factor=1.25) == 20  # ceil(2 * 32 * 1.25 / 4)
    assert moe.capacity(32, 8, top_k=3, capacity_factor=0.75) == 9  # ceil(3 * 32 * 0.75 / 8)
    assert moe.capacity(4, 8, top_k=1, capacity_factor=1.0) == 4  # min_capacity 4, at most 4 tokens
    assert moe.capacity(2, 8, top_k=1, capacity_factor=1.0) == 2  # never more than the tokens
    assert moe.capacity(100, 64, top_k=1, capacity_factor=1.0, min_capacity=1) == 2
    assert moe.capacity(32, 4, capacity_factor=None) == 32
    params, x = _skewed()
    # top-1, C = 8: tokens 0..7 kept, 24 of 32 dropped, and the dropped tokens' output is 0
    y, aux = moe.moe_layer(params, x, top_k=1, capacity_factor=1.0)
    assert float(aux["drop_fraction"]) == 24 / 32 and aux["load"].tolist() == [32, 0, 0, 0]
    assert torch.all(y[8:] == 0) and torch.all(y[:8].abs().sum(-1) > 0)
    # top-2, C = 16: tokens 0..15 fill expert 0 with their first choices and expert 1 with
    # their second; 32 of 64 choices dropped
    r = moe.route(x @ params["router"], top_k=2, capacity_factor=1.0)
    assert r.capacity == 16 and (~r.kept).sum() == 32 and float(r.drop_fraction) == 0.5
    assert r.kept[:16].all() and not r.kept[16:].any()
    # capacity factor 2: C = 32, room for every choice
    assert moe.route(x @ params["router"], top_k=2, capacity_factor=2.0).kept.all()
    assert r.load.tolist() == [32, 32, 0, 0]
    # dropless: nothing dropped
    _, aux = moe.moe_layer(params, x, top_k=2, capacity_factor=None)
    assert float(aux["drop_fraction"]) == 0.0


def test_balancing_losses_by_hand():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]], requires_grad=True)
    top1 = torch.tensor([0, 0, 1, 0])
    # f = (3/4, 1/4), P = (0.6, 0.4): 2 * (0.75 * 0.6 + 0.25 * 0.4) = 1.1
    loss = moe.load_balancing_loss(probs, top1)
    torch.testing.assert_close(loss, torch.tensor(1.1))
    loss.backward()  # d/dprobs[t, e] = E * f_e / T (f carries no gradient)
    torch.testing.assert_close(probs.grad, torch.tensor([[0.375, 0.125]]).expand(4, 2))
    uniform = moe.load_balancing_loss(torch.full((4, 4), 0.25), torch.arange(4))
    torch.testing.assert_close(uniform, torch.tensor(1.0))
    ln2 = math.log(2.0)
    z = moe.z_loss(torch.tensor([[0.0, 0.0], [1.0, 1.0]]))  # logsumexp: ln 2 and 1 + ln 2
    torch.testing.assert_close(z, torch.tensor((ln2**2 + (1 + ln2) ** 2) / 2))
    # the layer's aux is these of its own routing
    params, x = _params(4), _tokens()
    _, aux = moe.moe_layer(params, x, top_k=2)
    logits = x @ params["router"]
    torch.testing.assert_close(aux["z_loss"], moe.z_loss(logits))
    torch.testing.assert_close(aux["aux_loss"], moe.load_balancing_loss(
        torch.softmax(logits, -1), torch.argmax(logits, -1)))


def test_bias_balancing_moves_the_load_toward_uniform():
    assert moe.update_bias(torch.zeros(3), torch.tensor([4.0, 1.0, 1.0]), 0.1).tolist() == \
        pytest.approx([-0.1, 0.1, 0.1])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, generator=g) * 0.5 + torch.tensor([2.0, 1.0, 0.0, 0.0])

    def ratio(load):
        return float(load.max() / load.min().clamp(min=1))

    bias = torch.zeros(4)
    ratios = []
    for _ in range(50):
        r = moe.route(logits, top_k=1, capacity_factor=None, selection_bias=bias)
        ratios.append(ratio(r.load))
        # the bias picks the experts; the weights stay the unbiased probabilities
        torch.testing.assert_close(r.weights, r.probs.gather(1, r.experts))
        bias = moe.update_bias(bias, r.load, 0.01)
    # 60:1 at first; a fixed-size sign step ends in a small cycle around uniform (1.1 to 1.9 here)
    assert ratios[0] == 60 and all(b <= a for a, b in zip(ratios[:25], ratios[1:25]))
    assert max(ratios[-10:]) < 2


EP_CASES = [  # mesh, the axes the tokens are split over, capacity factor, method
    ({"expert": 2}, ("expert",), 1.0, "capacity"),
    ({"expert": 4}, ("expert",), 1.0, "capacity"),
    ({"data": 2, "expert": 2}, ("data", "expert"), 1.0, "capacity"),
    ({"expert": 2}, ("expert",), None, "sorted"),
    ({"data": 2}, ("data",), 1.0, "capacity"),  # no expert axis: every expert local
]


def _sharded(mesh_shape: dict, tok_axes: tuple, kw: dict):
    params = _params(8)
    specs = moe.expert_parallel_specs(params) if "expert" in mesh_shape else P()
    tok = P(tok_axes)

    def body(p, x):
        y, aux = moe.moe_layer(p, x, **kw)
        return y, aux["load"][None], aux["drop_fraction"][None]

    sm = fs.shard_map(body, mesh=fs.Mesh(mesh_shape), in_specs=(specs, tok), out_specs=(tok, tok, tok))
    return params, sm


@pytest.mark.parametrize("mesh_shape,tok_axes,cf,method", EP_CASES,
                         ids=lambda v: "-".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else str(v))
def test_expert_parallel_equals_the_layer_per_shard(mesh_shape, tok_axes, cf, method):
    kw = dict(top_k=2, capacity_factor=cf, min_capacity=1, method=method)
    params, sm = _sharded(mesh_shape, tok_axes, kw)
    x = _tokens()
    shards = math.prod(mesh_shape[a] for a in tok_axes)
    n = T // shards

    def per_shard(p, x):  # the single-device layer on each shard's tokens alone
        outs = [moe.moe_layer(p, x[i * n:(i + 1) * n], axis=None, **kw) for i in range(shards)]
        return (torch.cat([y for y, _ in outs]), torch.stack([a["load"] for _, a in outs]),
                torch.stack([a["drop_fraction"] for _, a in outs]))

    got, want = sm(params, x), per_shard(params, x)
    # fp32: the same per-row products; the expert matmuls batch differently: 1e-5
    _assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want[2] > 0).any() == (cf is not None)  # each shard drops by its own capacity
    cot = torch.randn(T, D, generator=torch.Generator().manual_seed(9))
    g = _grads(lambda p, x: sm(p, x)[0], params, x, cot)
    g_ref = _grads(lambda p, x: per_shard(p, x)[0], params, x, cot)
    _assert_trees_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape,tok_axes,cf,method", EP_CASES[:3], ids=["expert2", "expert4", "data2-expert2"])
def test_expert_parallel_regrouped_by_expert_equals_the_shard_major_form(mesh_shape, tok_axes, cf, method,
                                                                         monkeypatch):
    # CPU keeps the all-to-all's shard-major rows (one matmul per row); other devices
    # regroup them by expert for one batched matmul (forced here on CPU tensors): the same
    # outputs and gradients.
    kw = dict(top_k=2, capacity_factor=cf, min_capacity=1, method=method)
    params, sm = _sharded(mesh_shape, tok_axes, kw)
    x = _tokens()
    cot = torch.randn(T, D, generator=torch.Generator().manual_seed(9))
    runs = []
    for shard_major in (True, False):
        monkeypatch.setattr(moe, "_per_row", lambda buf, v=shard_major: v)
        runs.append((sm(params, x), _grads(lambda p, x: sm(p, x)[0], params, x, cot)))
    _assert_trees_close(runs[0], runs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shard_major", [True, False], ids=["per-row", "batched"])
@pytest.mark.parametrize("mesh_shape,tok_axes", [({"expert": 2}, ("expert",)), ({"expert": 4}, ("expert",)),
                                                 ({"data": 2, "expert": 2}, ("data", "expert"))])
def test_all_to_all_bytes(mesh_shape, tok_axes, shard_major, monkeypatch):
    # Each shard routes T_l = T / shards tokens into an (E, C, d) buffer with C =
    # capacity(T_l, E, top_k, cf); dispatch and return each send (n - 1)/n of it, n the
    # expert-axis size: forward bytes = 2 * E * C * d * 4 * (n - 1) / n. The CPU's
    # per-row experts keep the shard-major (E, C, d) layout; the batched form regroups
    # by expert, (E/n, n*C, d), before its return all-to-all.
    monkeypatch.setattr(moe, "_per_row", lambda buf: shard_major)
    E, top_k, cf = 8, 2, 1.0
    kw = dict(top_k=top_k, capacity_factor=cf, min_capacity=1)
    params, sm = _sharded(mesh_shape, tok_axes, kw)
    n = mesh_shape["expert"]
    T_l = T // math.prod(mesh_shape[a] for a in tok_axes)
    C = moe.capacity(T_l, E, top_k=top_k, capacity_factor=cf, min_capacity=1)
    assert C == math.ceil(top_k * T_l * cf / E)
    entries = sm.collectives(params, _tokens())
    assert [(e.op, e.axis) for e in entries] == [("all_to_all", "expert")] * 2
    assert [e.shape for e in entries] == [(E, C, D), (E, C, D) if shard_major else (E // n, n * C, D)]
    assert sum(e.bytes_sent for e in entries) == 2 * E * C * D * 4 * (n - 1) // n


def test_traces_with_make_fx():
    params, x = _params(4), _tokens()

    def step(p, x):
        def loss(p, x):
            y, aux = moe.moe_layer(p, x, top_k=2, capacity_factor=0.75)
            return (y**2).sum() + 0.01 * aux["aux_loss"] + 0.001 * aux["z_loss"]
        return torch.func.grad_and_value(loss)(p, x)

    traced = make_fx(step)(params, x)
    _assert_trees_close(traced(params, x), step(params, x), rtol=1e-6, atol=1e-6)


def test_mistakes_are_named():
    params = _params(4)
    x = _tokens()
    with pytest.raises(ValueError, match=r"top_k=5 but the router scores only 4 experts: use top_k <= 4"):
        moe.moe_layer(params, x, top_k=5)
    with pytest.raises(ValueError, match=r"top_k=5 but the router scores only 4 experts"):
        moe.route(torch.zeros(8, 4), top_k=5)
    six = moe.init(D, FF, 6)
    with pytest.raises(ValueError, match=r"6 experts .* do not divide over axis 'expert' of size 4: "
                                         r"use a number of experts divisible by 4"):
        moe.expert_parallel_specs(six, axis_size=4)

    def run(p, mesh):
        return fs.shard_map(lambda p, x: moe.moe_layer(p, x)[0], mesh=fs.Mesh(mesh), in_specs=(P(), P("expert")),
                            out_specs=P("expert"))(p, x)

    with pytest.raises(ValueError, match=r"the 6 experts do not divide over axis 'expert' of size 4: "
                                         r"use a number of experts divisible by 4"):
        run(six, {"expert": 4})
    with pytest.raises(ValueError, match=r"w1 holds 4 experts on each of the 2 shards .* shard w1, w2 .* "
                                         r"as P\('expert'\) on dim 0"):
        run(params, {"expert": 2})
    with pytest.raises(ValueError, match="method='sorted' is dropless; pass capacity_factor=None"):
        moe.moe_layer(params, x, method="sorted", capacity_factor=1.0)
    other = moe.init(D, FF + 4, 4)  # w2's hidden size not w1's
    with pytest.raises(ValueError, match=rf"w1 \(4, {D}, {FF}\) and w2 \(4, {FF + 4}, {D}\) do not fit"):
        moe.moe_layer({**params, "w2": other["w2"]}, x)


def _expert_tp(mesh_shape: dict, tok_axes: tuple, kw: dict):
    """The layer with each expert's hidden dim split over ``tensor`` (and the experts over
    ``expert`` when the mesh has it); the tokens are the same on every tensor shard."""
    params = _params(8)
    specs = moe.expert_parallel_specs(params, axis="expert" if "expert" in mesh_shape else None,
                                      tensor_axis="tensor")
    tok = P(tok_axes) if tok_axes else P()

    def body(p, x):
        y, aux = moe.moe_layer(p, x, tensor_axis="tensor", **kw)
        return y, aux["load"][None]

    sm = fs.shard_map(body, mesh=fs.Mesh(mesh_shape), in_specs=(specs, tok), out_specs=(tok, tok))
    return params, sm


@pytest.mark.parametrize("mesh_shape,tok_axes,method", [
    ({"tensor": 2}, (), "capacity"),
    ({"expert": 2, "tensor": 2}, ("expert",), "capacity"),
    ({"data": 2, "tensor": 2}, ("data",), "sorted"),
], ids=["tensor2", "expert2-tensor2", "data2-tensor2-sorted"])
def test_expert_tensor_parallel_equals_the_layer_per_shard(mesh_shape, tok_axes, method):
    # Expert TP: w1 split on its hidden dim, w2 and b1 alike, b2 whole; each tensor shard's
    # partial products summed by one psum of the experts' output buffer, b2 added once.
    kw = dict(top_k=2, capacity_factor=None if method == "sorted" else 1.0, min_capacity=1, method=method)
    params, sm = _expert_tp(mesh_shape, tok_axes, kw)
    x = _tokens()
    shards = math.prod(mesh_shape[a] for a in tok_axes)
    n = T // shards

    def per_shard(p, x):
        outs = [moe.moe_layer(p, x[i * n:(i + 1) * n], axis=None, **kw) for i in range(shards)]
        return torch.cat([y for y, _ in outs]), torch.stack([a["load"] for _, a in outs])

    got, want = sm(params, x), per_shard(params, x)
    _assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    cot = torch.randn(T, D, generator=torch.Generator().manual_seed(9))
    g = _grads(lambda p, x: sm(p, x)[0], params, x, cot)
    g_ref = _grads(lambda p, x: per_shard(p, x)[0], params, x, cot)
    _assert_trees_close(g, g_ref, rtol=1e-5, atol=1e-5)
    # One psum over tensor per layer, of the experts' output buffer, forward (and its
    # transpose for the tokens' gradient in backward).
    ops = [(e.op, e.axis, e.phase) for e in sm.collectives(params, x) if e.axis == "tensor"]
    assert ops.count(("psum", "tensor", "forward")) == 1, ops


def test_expert_tensor_parallel_needs_every_hidden_leaf_split():
    params = _params(8)
    specs = moe.expert_parallel_specs(params, axis=None, tensor_axis="tensor")
    specs["w2"] = P()  # w1 and b1 split, w2 whole: the partial sums would not add up
    sm = fs.shard_map(lambda p, x: moe.moe_layer(p, x, tensor_axis="tensor", axis=None, top_k=2)[0],
                      mesh=fs.Mesh({"tensor": 2}), in_specs=(specs, P()), out_specs=P())
    with pytest.raises(ValueError, match=r"only \['b1', 'w1'\] vary over it \(not \['w2'\]\)"):
        sm(params, _tokens())
    # Replicated weights with the axis bound: every tensor shard computes the whole MLP.
    sm = fs.shard_map(lambda p, x: moe.moe_layer(p, x, tensor_axis="tensor", axis=None, top_k=2)[0],
                      mesh=fs.Mesh({"tensor": 2}), in_specs=(P(), P()), out_specs=P())
    torch.testing.assert_close(sm(params, _tokens()), moe.moe_layer(params, _tokens(), axis=None, top_k=2)[0])


def test_dry_runs_take_the_expert_form_of_the_device_they_stand_for(monkeypatch):
    # The per-row form (CPU) keeps other activations than the batched one (CUDA): a dry
    # run on meta tensors (estimate_memory, the step's checks) measures the form the job runs.
    from fsharded.spmd import _schedule

    buf = torch.empty(4, 8, 16, device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with _schedule.stand_ins(_schedule.META) as convert:
        convert({"w": torch.zeros(2)})  # standing for CPU tensors
        assert _schedule.stands_for() == "cpu" and moe._per_row(buf)
    with _schedule.stand_ins(_schedule.META) as convert:
        convert({"w": torch.empty(2, device="meta")})  # a model built on meta: where the job would run
        assert _schedule.stands_for() == "cuda" and not moe._per_row(buf)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert moe._per_row(buf) and moe._per_row(torch.empty(1))
