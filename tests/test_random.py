"""fsharded.random: keys as data. Bits are a pure function of the key, the same under vmap,
inside shard_map on the virtual mesh, and on 2 and 4 gloo ranks; torch's random ops draw
from the key under ``scope``."""

import doctest
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsharded as fs
from fsharded import P
from fsharded import random as R
from fsharded.testing import run_on_ranks

N = 100_000  # draws for the statistical checks
M32 = 0xFFFFFFFF


def _sigmas(n_sigma: float, sd: float, n: int) -> float:
    """A tolerance of ``n_sigma`` standard errors for a mean of ``n`` draws of spread ``sd``:
    with fixed keys the checks are deterministic; 5 sigma keeps them from being fragile to
    the choice of key while still catching a biased or correlated generator."""
    return n_sigma * sd / math.sqrt(n)


# -- the generator and keys -------------------------------------------------------------


@pytest.mark.parametrize("k, counter, expected", [
    # Random123's known-answer vectors for Threefry-2x32-20 (kat_vectors), also JAX's.
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((M32, M32), (M32, M32), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
])
def test_threefry_known_answers(k, counter, expected):
    data = (counter[0] << 32) | counter[1]
    data = data - 2**64 if data >= 2**63 else data  # the same 64 bits as an int64
    got = R.fold_in(torch.tensor(k), data)  # fold_in hashes the counter (hi, lo) of data
    assert got.tolist() == list(expected)


def test_keys():
    assert R.key(0).tolist() == [0, 0]
    assert R.key(2**40 + 5).tolist() == [2**8, 5]
    assert R.key(-1).tolist() == [M32, M32]
    k = R.key(7)
    ks = R.split(k, 5)
    assert ks.shape == (5, 2) and ks.dtype == torch.int64
    assert ((ks >= 0) & (ks <= M32)).all()
    assert len({tuple(r) for r in ks.tolist()} | {tuple(k.tolist())}) == 6  # all distinct
    # split is fold_in over 0..n-1 (as with JAX's partitionable threefry)
    assert torch.equal(ks, torch.stack([R.fold_in(k, i) for i in range(5)]))
    assert torch.equal(R.fold_in(k, torch.tensor(3)), R.fold_in(k, 3))
    assert torch.equal(R.fold_in(k, torch.arange(5)), ks)  # one key per element
    assert not torch.equal(R.fold_in(k, 2**32), R.fold_in(k, 0))  # the high word counts
    assert torch.equal(R.split(k, 3), R.split(k, 3))  # a pure function of the key


def test_draws_are_pure_and_position_only():
    k = R.key(0)
    for draw in (R.bits, R.uniform, R.normal, lambda k, s: R.randint(k, s, -3, 9)):
        a = draw(k, (7,))
        assert torch.equal(a, draw(k, (7,)))
        assert not torch.equal(a, draw(R.key(1), (7,)))
        # the value at flat position i depends on the key and i only, not on the shape
        assert torch.equal(draw(k, (2, 3)).reshape(-1), a[:6])
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        u = R.uniform(k, (1000,), dtype)
        assert u.dtype == dtype and (u >= 0).all() and (u < 1).all()
        assert R.normal(k, (10,), dtype).dtype == dtype
    u = R.uniform(k, (1000,), torch.float64)
    assert (u * 2**52 == torch.round(u * 2**52)).all()  # 52 random bits, exact
    assert (u * 2**23 != torch.round(u * 2**23)).any()  # more than float32's 23
    v = R.uniform(k, (1000,), low=-2.0, high=3.0)
    assert v.min() >= -2 and v.max() < 3
    r = R.randint(k, (1000,), -3, 9)
    assert r.dtype == torch.int64 and set(r.tolist()) == set(range(-3, 9))
    b = R.bernoulli(k, torch.tensor([0.0, 1.0, 0.5]))
    assert b.dtype == torch.bool and b.shape == (3,) and not b[0] and b[1]


def test_statistics():
    k1, k2, k3 = R.split(R.key(123), 3)
    u, z = R.uniform(k1, (N,)), R.normal(k2, (N,), torch.float64)
    # U(0, 1): mean 1/2 (sd 1/sqrt(12)); variance 1/12, whose estimate has sd
    # sqrt((mu4 - sigma^4) / N) with mu4 = 1/80.
    assert abs(u.mean() - 0.5) < _sigmas(5, math.sqrt(1 / 12), N)
    assert abs(u.var() - 1 / 12) < _sigmas(5, math.sqrt(1 / 80 - 1 / 144), N)
    # ten equal bins: counts binomial(N, 0.1), sd sqrt(N * 0.1 * 0.9)
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - N / 10).abs().max() < 5 * math.sqrt(N * 0.09)
    # N(0, 1): mean sd 1/sqrt(N); the variance estimate has sd sqrt(2 / N); P(|z| < 1)
    # = erf(1/sqrt 2), a proportion with sd sqrt(p (1 - p) / N)
    assert abs(z.mean()) < _sigmas(5, 1, N)
    assert abs(z.var() - 1) < _sigmas(5, math.sqrt(2), N)
    p1 = math.erf(1 / math.sqrt(2))
    assert abs((z.abs() < 1).double().mean() - p1) < _sigmas(5, math.sqrt(p1 * (1 - p1)), N)
    # streams of different keys are uncorrelated: correlation sd 1/sqrt(N)
    w = R.uniform(k3, (N,))
    assert abs(torch.corrcoef(torch.stack([u, w]))[0, 1]) < _sigmas(5, 1, N)
    # dropout keeps a binomial(N, 1 - p) share, each kept value scaled by 1 / (1 - p)
    p = 0.1
    y = R.dropout(k3, torch.ones(N), p)
    kept = y != 0
    assert abs(kept.double().mean() - (1 - p)) < _sigmas(5, math.sqrt(p * (1 - p)), N)
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / (1 - p)))


def test_dropout_semantics():
    k, x = R.key(1), torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0))
    assert R.dropout(k, x, 0.0) is x and R.dropout(k, x, 0.7, training=False) is x
    assert torch.equal(R.dropout(k, x, 1.0), torch.zeros_like(x))
    y = R.dropout(k, x, 0.25)
    keep = R.bernoulli(k, 0.75, x.shape)
    assert torch.equal(y, torch.where(keep, x * (1 / 0.75), 0.0))
    c = R.dropout(k, x, 0.5, broadcast_dims=(2,))  # one mask value per (dim 0, dim 1)
    zero = c == 0
    assert (zero.all(2) | (~zero).all(2)).all()
    with pytest.raises(ValueError, match="between 0 and 1"):
        R.dropout(k, x, 1.5)
    g = torch.func.grad(lambda x: R.dropout(k, x, 1.0).sum())(x)
    assert torch.equal(g, torch.zeros_like(x))  # p = 1: a zero gradient, not NaN


def test_bad_keys_name_the_fix():
    with pytest.raises(TypeError, match=r"uniform: key must be an int64 tensor of shape \(2,\)"):
        R.uniform(torch.tensor([1.0, 2.0]), (3,))
    with pytest.raises(TypeError, match="vmap over them"):
        R.normal(R.split(R.key(0), 4), (3,))
    with pytest.raises(TypeError, match="fold_in: data must be an integer"):
        R.fold_in(R.key(0), 1.5)
    with pytest.raises(ValueError, match="randint"):
        R.randint(R.key(0), (3,), 0, 2**40)


# -- transforms -------------------------------------------------------------------------


def test_vmap_over_keys_equals_the_loop():
    keys = R.split(R.key(5), 4)
    x = torch.ones(4, 6)
    draws = {
        "uniform": lambda k: R.uniform(k, (3, 2)),
        "normal": lambda k: R.normal(k, (5,)),
        "bits": lambda k: R.bits(k, (5,)),
        "randint": lambda k: R.randint(k, (5,), 0, 7),
        "fold_in": lambda k: R.fold_in(k, 3),
        "split": lambda k: R.split(k, 3),
        "dropout": lambda k: R.dropout(k, x, 0.5),
    }
    for name, f in draws.items():
        assert torch.equal(torch.func.vmap(f)(keys), torch.stack([f(k) for k in keys])), name
    seeds = torch.arange(3)
    assert torch.equal(torch.func.vmap(R.key)(seeds), torch.stack([R.key(i) for i in range(3)]))


def test_grad_is_mask_times_scale():
    k, x = R.key(2), torch.randn(5, 7, dtype=torch.float64)
    g = torch.func.grad(lambda x: R.dropout(k, x, 0.3).sum())(x)
    keep = R.bernoulli(k, 0.7, x.shape)
    assert torch.equal(g, keep.to(x.dtype) * (1 / 0.7))
    w = torch.ones(3, requires_grad=True)
    assert not R.uniform(k, (3,)).requires_grad and (w * R.normal(k, (3,))).requires_grad


# -- inside shard_map -------------------------------------------------------------------


def test_shard_key_per_shard_on_the_virtual_mesh():
    k = R.key(9)
    mesh = fs.Mesh({"data": 4})

    def body(x):
        sk = R.shard_key(k, "data")
        return R.uniform(sk, (1, 3)), R.dropout(sk, x, 0.5), fs.varying_axes(R.normal(sk, ()))

    x = torch.ones(4, 16)
    types = []

    def typed(x):
        u, y, t = body(x)
        types.append(t)
        return u, y

    u, y = fs.shard_map(typed, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")))(x)
    assert types == [("data",)]
    loop_u = torch.cat([R.uniform(R.fold_in(k, i), (1, 3)) for i in range(4)])
    loop_y = torch.cat([R.dropout(R.fold_in(k, i), x[i:i + 1], 0.5) for i in range(4)])
    assert torch.equal(u, loop_u) and torch.equal(y, loop_y)
    assert len({tuple(r) for r in (y != 0).tolist()}) == 4  # every shard its own mask
    assert R.shard_key(k, "data") is k  # outside shard_map: the key itself


def test_shard_key_agrees_over_axes_it_does_not_name():
    """On data x tensor, a key folded over data only gives tensor-parallel replicas the same
    mask: the result is typed varying over data alone, so out_specs may leave tensor out."""
    k = R.key(3)
    mesh = fs.Mesh({"data": 2, "tensor": 2})

    def body(x):
        with R.scope(R.shard_key(k, "data")):
            return F.dropout(x, 0.5)

    x = torch.ones(2, 32)
    y = fs.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)
    assert torch.equal(y, torch.cat([R.dropout(R.fold_in(R.fold_in(k, i), 0), x[i:i + 1], 0.5)
                                     for i in range(2)]))
    both = fs.shard_map(lambda x: R.uniform(R.shard_key(k, ("tensor", "data")), (1, 1, 4)),
                        mesh=mesh, in_specs=P(), out_specs=P("data", "tensor"))(x)
    # the combined index, major axis first in mesh order: 2 * data + tensor
    expected = torch.cat([torch.cat([R.uniform(R.fold_in(k, 2 * d + t), (1, 1, 4))
                                     for t in range(2)], dim=1) for d in range(2)], dim=0)
    assert torch.equal(both, expected)


def test_scope_outside_shard_map_is_the_same_on_every_shard():
    k = R.key(4)
    f = fs.shard_map(lambda x: F.dropout(x, 0.5), mesh=fs.Mesh({"data": 2}), in_specs=P(),
                     out_specs=P())  # an invariant key: an invariant result
    x = torch.ones(16)
    with R.scope(k):
        y = f(x)
    assert torch.equal(y, R.dropout(R.fold_in(k, 0), x, 0.5))


# -- torch's own random ops under a scope -----------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.GELU(), nn.Linear(16, 8),
                         nn.Dropout(0.2))


def test_scope_covers_torch_random_ops():
    k, x = R.key(11), torch.zeros(2, 3)
    nth = lambda i: R.fold_in(k, i)  # noqa: E731
    with R.scope(k) as s:
        a, b = torch.rand(3), torch.randn((2, 2), dtype=torch.float64)
        c, d = torch.rand_like(x), torch.randn_like(x)
        e, f = torch.randint(10, (4,)), torch.randint(2, 10, size=(4,))
        g = torch.bernoulli(torch.full((5,), 0.3))
        h = torch.empty(6).uniform_(-1, 1)
        i = torch.empty(6).normal_(2.0, 3.0)
        j = torch.normal(torch.zeros(4), torch.ones(4))
        assert s.calls == 10
    assert torch.equal(a, R.uniform(nth(0), (3,)))
    assert torch.equal(b, R.normal(nth(1), (2, 2), torch.float64))
    assert torch.equal(c, R.uniform(nth(2), (2, 3))) and torch.equal(d, R.normal(nth(3), (2, 3)))
    assert torch.equal(e, R.randint(nth(4), (4,), 0, 10))
    assert torch.equal(f, R.randint(nth(5), (4,), 2, 10))
    assert torch.equal(g, R.bernoulli(nth(6), torch.full((5,), 0.3)).float())
    assert torch.equal(h, R.uniform(nth(7), (6,), low=-1.0, high=1.0))
    assert torch.equal(i, R.normal(nth(8), (6,)) * 3.0 + 2.0)
    assert torch.equal(j, R.normal(nth(9), (4,)))


def test_module_init_and_dropout_follow_the_key():
    with R.scope(R.key(1)):
        m1 = _mlp()
    with R.scope(R.key(1)):
        m2 = _mlp()
    with R.scope(R.key(2)):
        m3 = _mlp()
    p1, p2, p3 = (torch.cat([p.flatten() for p in m.parameters()]) for m in (m1, m2, m3))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    run = lambda k: _under(k, m1, x)  # noqa: E731
    assert torch.equal(run(R.key(5)), run(R.key(5)))
    assert not torch.equal(run(R.key(5)), run(R.key(6)))
    m1.eval()
    with R.scope(R.key(5)) as s:
        assert torch.equal(m1(x), m1[3](m1[2](m1[0](x))))  # eval: dropout is the identity
    assert s.calls == 0


def _under(k, m, x):
    with R.scope(k):
        return m(x)


def test_module_under_vmap_and_grad():
    drop = nn.Dropout(0.1)
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    keys = R.split(R.key(8), 3)
    # a batch of keys: each example its own stream, as in the loop
    batched = torch.func.vmap(lambda k, x: _under(k, drop, x))(keys, x)
    assert torch.equal(batched, torch.stack([_under(k, drop, xi) for k, xi in zip(keys, x)]))
    # one key over a vmapped batch: every example the same mask (JAX's semantics)
    k = R.key(8)
    with R.scope(k):
        shared = torch.func.vmap(drop)(x)
    assert torch.equal(shared, torch.stack([R.dropout(R.fold_in(k, 0), xi, 0.1) for xi in x]))
    with R.scope(k):
        g = torch.func.grad(lambda x: drop(x).sum())(x)
    assert torch.equal(g, R.bernoulli(R.fold_in(k, 0), 0.9, x.shape) * (1 / 0.9))
    xr = x.clone().requires_grad_()
    with R.scope(k):
        drop(xr).sum().backward()
    assert torch.equal(xr.grad, g)


def test_feature_inplace_native_and_attention_dropout():
    k = R.key(12)
    nth = lambda i: R.fold_in(k, i)  # noqa: E731
    x = torch.randn(2, 6, 3, 3, generator=torch.Generator().manual_seed(3))
    q, kk, v = torch.randn(3, 1, 2, 5, 4, generator=torch.Generator().manual_seed(4))
    with R.scope(k):
        c = F.dropout2d(x, 0.5)
        ip = nn.Dropout(0.5, inplace=True)(x.clone())
        out, mask = torch.native_dropout(x, 0.5, True)
        att = F.scaled_dot_product_attention(q, kk, v, dropout_p=0.3, is_causal=True)
        plain = F.scaled_dot_product_attention(q, kk, v, is_causal=True)  # no dropout: torch's
    assert torch.equal(c, R.dropout(nth(0), x, 0.5, broadcast_dims=(2, 3)))
    assert torch.equal(ip, R.dropout(nth(1), x, 0.5))
    assert torch.equal(out, R.dropout(nth(2), x, 0.5))
    assert torch.equal(mask, R.bernoulli(nth(2), 0.5, x.shape))
    scores = (q @ kk.transpose(-2, -1) / 2.0).masked_fill(~torch.ones(5, 5).tril().bool(), -math.inf)
    ref = R.dropout(nth(3), torch.softmax(scores, -1), 0.3) @ v
    assert torch.allclose(att, ref, atol=1e-6)  # the same math; 1e-6: float32 rounding
    assert torch.equal(plain, F.scaled_dot_product_attention(q, kk, v, is_causal=True))


def test_scopes_nest_and_fork():
    k1, k2 = R.split(R.key(13))
    assert R.fork() is None
    with R.scope(k1) as outer:
        a = torch.rand(2)
        with R.scope(k2):
            b = torch.rand(2)
            assert torch.equal(R.fork(), R.fold_in(k2, 1))
        c = torch.rand(2)
    assert outer.calls == 2
    assert torch.equal(a, R.uniform(R.fold_in(k1, 0), (2,)))
    assert torch.equal(b, R.uniform(R.fold_in(k2, 0), (2,)))
    assert torch.equal(c, R.uniform(R.fold_in(k1, 1), (2,)))


@pytest.mark.parametrize("op, name", [
    (lambda: torch.randperm(5), "torch.randperm"),
    (lambda: torch.multinomial(torch.ones(4), 2), "torch.multinomial"),
    (lambda: torch.empty(3).exponential_(), "Tensor.exponential_"),
    (lambda: torch.ones(3).random_(), "Tensor.random_"),
    (lambda: F.gumbel_softmax(torch.zeros(2, 3)), "F.gumbel_softmax"),
    (lambda: F.rrelu(torch.ones(3), training=True), "F.rrelu"),
    (lambda: nn.MultiheadAttention(4, 1, dropout=0.1)(*[torch.ones(2, 1, 4)] * 3),
     "nn.MultiheadAttention"),
    (lambda: torch.rand(3, generator=torch.Generator()), "rand(generator=...)"),
])
def test_uncovered_random_ops_raise_naming_them(op, name):
    with R.scope(R.key(0)), pytest.raises(NotImplementedError, match=r"(?s)" + name.replace(
            "(", r"\(").replace(")", r"\)").replace(".", r"\.") + ".*scope"):
        op()


def test_deterministic_forms_pass_through():
    x = torch.linspace(-1, 1, 6)
    with R.scope(R.key(0)) as s:
        assert torch.equal(F.rrelu(x, training=False), F.leaky_relu(x, (1 / 8 + 1 / 3) / 2))
        assert torch.equal(F.alpha_dropout(x, 0.5, training=False), x)
        mha = nn.MultiheadAttention(4, 1, dropout=0.1).eval()
        mha(*[torch.ones(2, 1, 4)] * 3)
    # only nn.MultiheadAttention's init drew: in_proj's xavier_uniform_ (through
    # Tensor.uniform_), out_proj's kaiming_uniform_ and its bias' uniform_
    assert s.calls == 3


def test_hf_gpt2_dropout_on_the_virtual_mesh():
    """A Hugging Face model's dropout (nn.Dropout and sdpa's dropout_p) runs on the virtual
    mesh under a scope, shard by shard what a loop over shard keys gives."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                  n_head=2, attn_implementation="sdpa")
    with R.scope(R.key(1)):
        model = transformers.GPT2LMHeadModel(cfg).train()
    tokens = R.randint(R.key(2), (4, 8), 0, 64)
    k = R.key(3)

    def body(t):
        with R.scope(R.shard_key(k, "data")):
            return model(t).logits

    y = fs.shard_map(body, mesh=fs.Mesh({"data": 2}), in_specs=P("data"), out_specs=P("data"))(
        tokens)
    loop = [_under(R.fold_in(k, i), lambda t: model(t).logits, tokens[2 * i:2 * i + 2])
            for i in range(2)]
    assert torch.equal(y, torch.cat(loop))
    assert not torch.equal(loop[0], _under(R.fold_in(k, 0), lambda t: model(t).logits,
                                           tokens[2:]))  # the shards' masks differ


def test_docstring_examples_run():
    assert doctest.testmod(R, raise_on_error=False).failed == 0


# -- the same bits on gloo ranks ---------------------------------------------------------


def _cases(world: int) -> dict:
    """Draws inside shard_map: on the virtual mesh in this process, on ranks under
    run_on_ranks (the backend follows the process group)."""
    k = R.key(42)
    mesh = fs.Mesh({"data": world})
    with R.scope(R.key(7)):
        model = _mlp()
    x = torch.linspace(-2, 2, world * 2 * 8).reshape(world * 2, 8)

    drops = nn.Sequential(nn.Dropout(0.1), nn.GELU(), nn.Dropout(0.2))  # no matmul: exact

    def body(x):
        sk = R.shard_key(k, "data")
        with R.scope(sk):
            y, d = model(x), drops(x)
            r = torch.rand(1, 5)
            g = torch.func.grad(lambda x: F.dropout(x, 0.25).sum())(x)
        return y, d, r, g, R.uniform(sk, (1, 3)), R.normal(sk, (1, 3)), R.bits(sk, (1, 3))

    specs = (P("data"),) * 7
    names = ("model", "drops", "rand", "grad", "uniform", "normal", "bits")
    out = dict(zip(names, fs.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=specs)(x)))
    if world == 4:  # tensor-parallel replicas draw the same
        tp = fs.Mesh({"data": 2, "tensor": 2})

        def tp_body(x):
            with R.scope(R.shard_key(k, "data")):
                return F.dropout(x, 0.5)

        out["tp"] = fs.shard_map(tp_body, mesh=tp, in_specs=P("data"), out_specs=P("data"))(x)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_draw_what_the_virtual_mesh_draws(world):
    virtual = _cases(world)
    for rank, got in enumerate(run_on_ranks(_cases, world, world)):
        assert got.keys() == virtual.keys()
        for name in virtual:
            if name == "model":  # the masks exactly; the values up to the matmuls, which
                # vmap (one batched matmul) and a rank (its shard's) block differently
                assert torch.equal(got[name] == 0, virtual[name] == 0), rank
                torch.testing.assert_close(got[name], virtual[name], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(got[name], virtual[name]), (rank, name)


@pytest.mark.gpu
def test_the_same_bits_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    k = R.key(5)
    for f in (lambda k: R.bits(k, (1000,)), lambda k: R.uniform(k, (1000,)),
              lambda k: R.dropout(k, torch.ones(1000, device=k.device), 0.3),
              lambda k: R.randint(k, (1000,), 0, 1000), lambda k: R.split(k, 4)):
        assert torch.equal(f(k), f(k.cuda()).cpu())
    # normal goes through erfinv, whose CPU and CUDA kernels may differ in the last bit
    torch.testing.assert_close(R.normal(k, (1000,)), R.normal(k.cuda(), (1000,)).cpu())
