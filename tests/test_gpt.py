"""The functional GPT against a plain nn.Module GPT (forward and gradients), and its
Megatron tensor-parallel form on the virtual mesh against the unsharded model."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.models.gpt import GPTConfig

# float64 everywhere below: the implementations differ only in operation order (einsum vs
# Linear, explicit softmax vs SDPA, sharded partial sums), so they agree to ~1e-15
# relative; 1e-10 leaves room for accumulation over a few layers and nothing more.
TOL = dict(rtol=1e-10, atol=1e-12)
DT = torch.float64

GPT2ISH = GPTConfig.tiny(vocab_size=32, seq_len=8)  # layernorm, gelu, learned, tied, bias
LLAMAISH = GPTConfig.tiny(vocab_size=32, seq_len=8, norm="rmsnorm", activation="swiglu",
                          positions="rotary", tied_embeddings=False, n_kv_heads=2, bias=False)
MIXED = GPTConfig.tiny(vocab_size=32, seq_len=8, activation="swiglu", n_kv_heads=1,
                       mlp_ratio=2)  # multi-query, biased SwiGLU, learned positions
CONFIGS = {"gpt2ish": GPT2ISH, "llamaish": LLAMAISH, "mixed": MIXED}


# ------------------------------------------------------------------------------------------
# An independent reference: nn.Module layers, SDPA, complex-number rotary.
# ------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-5)

    def forward(self, x):
        return self.norm(x)


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c = c
        D, H, KV, Dh = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        self.q = nn.Linear(D, H * Dh, bias=c.bias)
        self.k = nn.Linear(D, KV * Dh, bias=c.bias)
        self.v = nn.Linear(D, KV * Dh, bias=c.bias)
        self.o = nn.Linear(H * Dh, D, bias=c.bias)

    def rope(self, x):  # (B, h, T, Dh); pairs dim i with i + Dh/2 as a complex number
        T, Dh = x.shape[2], x.shape[3]
        freqs = 1.0 / (10000.0 ** (torch.arange(0, Dh, 2, dtype=x.dtype) / Dh))
        angles = torch.outer(torch.arange(T, dtype=x.dtype), freqs)  # (T, Dh/2)
        rot = torch.polar(torch.ones_like(angles), angles)
        z = torch.complex(x[..., : Dh // 2], x[..., Dh // 2 :]) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    def forward(self, x):
        B, T, _ = x.shape
        c = self.c
        q = self.q(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if c.positions == "rotary":
            q, k = self.rope(q), self.rope(k)
        rep = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.swiglu = c.activation == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(c.d_model, c.d_ff, bias=c.bias)
        self.up = nn.Linear(c.d_model, c.d_ff, bias=c.bias)
        self.down = nn.Linear(c.d_ff, c.d_model, bias=c.bias)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x) if self.swiglu else nn.GELU()(self.up(x))
        return self.down(h)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        Norm = nn.LayerNorm if c.norm == "layernorm" else RMSNorm
        self.norm1, self.attn = Norm(c.d_model), Attention(c)
        self.norm2, self.mlp = Norm(c.d_model), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(c.vocab_size, c.d_model)
        if c.positions == "learned":
            self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.final_norm = nn.LayerNorm(c.d_model) if c.norm == "layernorm" else RMSNorm(c.d_model)
        if not c.tied_embeddings:
            self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        if self.c.positions == "learned":
            x = x + self.pos(torch.arange(tokens.shape[1]))
        for b in self.blocks:
            x = b(x)
        x = self.final_norm(x)
        return self.head(x) if not self.c.tied_embeddings else x @ self.emb.weight.T

    @torch.no_grad()
    def load_functional(self, params):
        """Copy a functional param tree in; returns {module param name: functional path}."""
        c, names = self.c, {}

        def put(mod_name, value, path, transform=lambda t: t):
            dict(self.named_parameters())[mod_name].copy_(transform(value))
            names[mod_name] = path

        def norm(prefix, p, path):
            w = "norm.weight" if c.norm == "rmsnorm" else "weight"
            put(f"{prefix}.{w}", p["w"], f"{path}.w")
            if c.norm == "layernorm":
                put(f"{prefix}.bias", p["b"], f"{path}.b")

        put("emb.weight", params["emb"], "emb")
        if "pos" in params:
            put("pos.weight", params["pos"], "pos")
        for i, b in enumerate(params["blocks"]):
            pre, a, m = f"blocks.{i}", b["attn"], b["mlp"]
            norm(f"{pre}.norm1", b["norm1"], f"{pre}.norm1")
            norm(f"{pre}.norm2", b["norm2"], f"{pre}.norm2")
            for n in "qkv":
                w, b = f"{pre}.attn.{n}", f"{pre}.attn"
                put(f"{w}.weight", a[f"w{n}"], f"{b}.w{n}", lambda t: t.flatten(1).T)  # (D, h*Dh).T
                if c.bias:
                    put(f"{w}.bias", a[f"b{n}"], f"{b}.b{n}", lambda t: t.flatten())
            put(f"{pre}.attn.o.weight", a["wo"], f"{pre}.attn.wo", lambda t: t.flatten(0, 1).T)
            if c.bias:
                put(f"{pre}.attn.o.bias", a["bo"], f"{pre}.attn.bo")
            lin = {"up": "w_up", "gate": "w_gate", "down": "w_down"} if c.activation == "swiglu" \
                else {"up": "w_in", "down": "w_out"}
            for mod, key in lin.items():
                put(f"{pre}.mlp.{mod}.weight", m[key], f"{pre}.mlp.{key}", lambda t: t.T)
                if c.bias:
                    bkey = "b" + key[1:]
                    put(f"{pre}.mlp.{mod}.bias", m[bkey], f"{pre}.mlp.{bkey}")
        norm("final_norm", params["final_norm"], "final_norm")
        if "head" in params:
            put("head.weight", params["head"], "head", lambda t: t.T)
        return names


def _get(tree, path):
    for k in path.split("."):
        tree = tree[int(k)] if isinstance(tree, list) else tree[k]
    return tree


def _randomized(config, seed=0):
    """Init, then perturb every leaf (biases and norms start at 0 / 1, which would hide
    mistakes such as a dropped bias or a swapped norm weight)."""
    params = gpt.init(config, seed, dtype=DT)
    g = torch.Generator().manual_seed(seed + 1)
    return optree.tree_map(lambda x: x + 0.1 * torch.randn(x.shape, generator=g, dtype=DT), params)


def _batch(config, B=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, config.vocab_size, (B, config.seq_len + 1), generator=g)}


# ------------------------------------------------------------------------------------------
# Functional vs nn.Module
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_module_forward_and_grad(name):
    c = CONFIGS[name]
    params, batch = _randomized(c), _batch(c)
    ref = GPT(c).to(DT)
    names = ref.load_functional(params)
    assert set(names) == {n for n, _ in ref.named_parameters()}, "every module weight loaded"
    assert sorted(names.values()) == sorted(fs.tree_flatten_with_paths(params)[0])

    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    torch.testing.assert_close(gpt.apply(params, inputs), ref(inputs), **TOL)

    value, grads = torch.func.grad_and_value(gpt.loss)(params, batch)[::-1]
    ref_loss = F.cross_entropy(ref(inputs).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    torch.testing.assert_close(value, ref_loss.detach(), **TOL)
    params_by_name = dict(ref.named_parameters())
    for mod_name, path in names.items():
        g_ref = params_by_name[mod_name].grad
        g = _get(grads, path)
        # Map the functional gradient into the module's layout the same way as the weights.
        g = _to_module_layout(path, g)
        torch.testing.assert_close(g, g_ref, **TOL, msg=f"d loss / d {path}")


def _to_module_layout(path, g):
    leaf = path.rsplit(".", 1)[-1]
    if leaf in ("wq", "wk", "wv"):
        return g.flatten(1).T
    if leaf == "wo":
        return g.flatten(0, 1).T
    if leaf in ("bq", "bk", "bv"):
        return g.flatten()
    if leaf in ("w_in", "w_out", "w_gate", "w_up", "w_down", "head"):
        return g.T
    return g


@pytest.mark.parametrize("name", ["gpt2ish", "llamaish"])
def test_sdpa_and_inputs_targets_batch(name):
    c = CONFIGS[name]
    params, batch = _randomized(c), _batch(c)
    l = gpt.loss(params, batch)
    torch.testing.assert_close(gpt.loss(params, batch, attention="sdpa"), l, **TOL)
    split = {"inputs": batch["tokens"][:, :-1], "targets": batch["tokens"][:, 1:]}
    torch.testing.assert_close(gpt.loss(params, split), l, rtol=0, atol=0)


def test_init_structure_and_loss():
    c = GPTConfig.small()
    params = gpt.init(c, seed=0)
    leaves = optree.tree_leaves(params)
    assert all(x.dtype == torch.float32 for x in leaves)
    assert isinstance(params["blocks"], list) and len(params["blocks"]) == c.n_layers
    assert gpt.param_count(params) == sum(p.numel() for p in GPT(c).parameters())
    # Same seed, same params; float64 init is the float32 init widened.
    p64 = gpt.init(c, seed=0, dtype=DT)
    for a, b in zip(leaves, optree.tree_leaves(p64)):
        assert torch.equal(a.double(), b)
    assert not torch.equal(gpt.init(c, seed=1)["emb"], params["emb"])
    # Near-uniform predictions at init: loss ~ ln V.
    l = gpt.loss(params, _batch(c, B=2))
    assert abs(l.item() - math.log(c.vocab_size)) < 0.1


def test_block_fn_hook_and_every_param_gets_gradient():
    c = LLAMAISH
    params, batch = _randomized(c), _batch(c)
    calls = []

    def wrapped(block, p, x, **kw):
        calls.append(kw)
        assert block is gpt.block
        return block(p, x, **kw)

    torch.testing.assert_close(gpt.loss(params, batch, block_fn=wrapped), gpt.loss(params, batch))
    assert calls[0] == {"rotary": True, "attention": "auto", "tensor_axis": "tensor"}
    grads = torch.func.grad(gpt.loss)(params, batch)
    assert all(bool(g.abs().sum() > 0) for g in optree.tree_leaves(grads))


# ------------------------------------------------------------------------------------------
# Tensor parallel (and data parallel) on the virtual mesh
# ------------------------------------------------------------------------------------------


def _step(params, batch):
    """Per shard: gradient of the local loss; the mean over data shards. The parameters are
    invariant over data, so (JAX's rule) their gradients come back summed over it."""
    grads, value = torch.func.grad_and_value(gpt.loss)(params, batch)
    if fs.is_bound("data"):
        value = fs.pmean(value, "data")
        grads = optree.tree_map(lambda g: g / fs.axis_size("data"), grads)
    return value, grads


@pytest.mark.parametrize(
    "name,mesh_axes",
    [("gpt2ish", {"data": 2, "tensor": 2}), ("llamaish", {"data": 2, "tensor": 2}),
     ("gpt2ish", {"tensor": 4}), ("llamaish", {"data": 2})],
)
def test_sharded_equals_unsharded(name, mesh_axes):
    c = CONFIGS[name]
    if "tensor" in mesh_axes:
        c.check_tensor_parallel(mesh_axes["tensor"])
    params, batch = _randomized(c), _batch(c)
    mesh = fs.Mesh(mesh_axes)
    specs = gpt.tensor_parallel_specs(params) if "tensor" in mesh_axes else P()
    batch_spec = P("data") if "data" in mesh_axes else P()
    sm = fs.shard_map(_step, mesh=mesh, in_specs=(specs, batch_spec), out_specs=(P(), specs),
                      check_rep=True)
    value, grads = sm(params, batch)
    ref_grads, ref_value = torch.func.grad_and_value(gpt.loss)(params, batch)
    torch.testing.assert_close(value, ref_value, **TOL)
    paths, got, _ = fs.tree_flatten_with_paths(grads)
    for path, g, r in zip(paths, got, optree.tree_leaves(ref_grads)):
        torch.testing.assert_close(g, r, **TOL, msg=f"d loss / d {path}")


def test_tensor_parallel_specs_and_manifest():
    c = GPT2ISH
    params, batch = _randomized(c), _batch(c)
    specs = gpt.tensor_parallel_specs(params)
    attn, mlp = specs["blocks"][1]["attn"], specs["blocks"][1]["mlp"]
    assert attn["wq"] == P(None, "tensor", None) and attn["wo"] == P("tensor", None, None)
    assert attn["bk"] == P("tensor") and attn["bo"] == P()
    assert mlp["w_in"] == P(None, "tensor") and mlp["w_out"] == P("tensor", None)
    assert mlp["b_in"] == P("tensor") and mlp["b_out"] == P()
    assert specs["emb"] == specs["pos"] == specs["final_norm"]["w"] == P()
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    sm = fs.shard_map(_step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
    ops = [(e.op, e.axis, e.phase) for e in sm.collectives(params, batch)]
    # Forward: one psum over tensor per attention and per MLP (Megatron's g) per layer.
    assert ops.count(("psum", "tensor", "forward")) == 2 * c.n_layers


def test_tensor_parallel_size_errors():
    c = GPTConfig.tiny(n_kv_heads=2)
    with pytest.raises(ValueError, match="n_kv_heads = 2 is not divisible by the tensor-parallel"):
        c.check_tensor_parallel(4)
    params = gpt.init(c)
    mesh = fs.Mesh({"tensor": 4})
    sm = fs.shard_map(gpt.loss, mesh=mesh, in_specs=(gpt.tensor_parallel_specs(params), P()),
                      out_specs=P())
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.wk"):
        sm(params, _batch(c))


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(d_model=30, n_heads=4), r"d_model \(30\) must be divisible by n_heads \(4\)"),
        (dict(n_heads=4, n_kv_heads=3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        (dict(norm="batchnorm"), r"norm must be one of \['layernorm', 'rmsnorm'\], got 'batchn"),
        (dict(activation="relu"), "activation must be one of"),
        (dict(positions="alibi"), "positions must be one of"),
        (dict(vocab_size=0), "vocab_size must be a positive int, got 0"),
        (dict(n_layers=2.0), "n_layers must be a positive int"),
        (dict(mlp_ratio=1.1), "is not a whole number"),
        (dict(init_std=-1.0), "init_std must be a positive number"),
        (dict(d_model=12, n_heads=4, positions="rotary"), "rotary positions need an even head_dim"),
        (dict(tied_embeddings="yes"), "tied_embeddings must be a bool"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.tiny(**kwargs)


def test_bad_config_lists_every_error():
    with pytest.raises(ValueError) as e:
        GPTConfig(vocab_size=-1, norm="x", activation="y")
    msg = str(e.value)
    assert "vocab_size" in msg and "norm" in msg and "activation" in msg


def test_bad_inputs():
    c = GPT2ISH
    params = gpt.init(c)
    with pytest.raises(ValueError, match="exceeds the 8 learned positions"):
        gpt.apply(params, torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor of shape"):
        gpt.apply(params, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="'tokens'"):
        gpt.loss(params, {"x": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="attention must be one of"):
        gpt.apply(params, torch.zeros(1, 4, dtype=torch.long), attention="bogus")
    with pytest.raises(TypeError, match="GPTConfig"):
        gpt.init({"d_model": 4})


def test_auto_attention_on_cpu_takes_the_fused_kernel_from_256_tokens():
    """On CPU, "auto" is the einsum form below CPU_FLASH_MIN_TOKENS and torch's fused flash
    kernel from there on (bitwise the "flash" choice), equal to the einsum form to fp32
    rounding, values and gradients (the llamaish config: GQA and rotary positions)."""
    c = LLAMAISH
    params = gpt.init(c, seed=3)
    for T, fused in ((gpt.CPU_FLASH_MIN_TOKENS // 2, False), (gpt.CPU_FLASH_MIN_TOKENS, True)):
        tokens = torch.randint(0, c.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(T))
        grads = {a: torch.func.grad(lambda p, a=a, t=tokens: gpt.loss(p, {"tokens": t}, attention=a))(params)
                 for a in ("auto", "flash", "einsum")}
        same = "flash" if fused else "einsum"
        for g, h in zip(optree.tree_leaves(grads["auto"]), optree.tree_leaves(grads[same])):
            torch.testing.assert_close(g, h, rtol=0, atol=0)
        for g, h in zip(optree.tree_leaves(grads["flash"]), optree.tree_leaves(grads["einsum"])):
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
