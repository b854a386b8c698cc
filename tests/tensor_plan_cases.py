"""Tensor-parallel plans on plain nn.Modules: the models and the runs shared by the
single-process tests and the gloo ranks (``run_on_ranks`` imports this module by name)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import optree
import torch
import torch.nn.functional as F
from torch import nn

import fsharded as fs
from fsharded import P
from fsharded.parallel import tensor as tp_lib

LR, WD, CLIP, STEPS, BATCH = 3e-3, 0.01, 1.0, 20, 8


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # GQA: two query heads per key/value head
    ffn: int = 64
    seq: int = 8


# -- an HF-Llama-style model (the names HF Llama/Mistral/Qwen2 use) ----------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _causal_softmax_attention(q, k, v):  # (B, H, T, Dh) each
    t = q.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v


class LlamaAttention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.head_dim = c.dim // c.heads
        self.groups = c.heads // c.kv_heads
        self.q_proj = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x):
        shape = (*x.shape[:-1], -1, self.head_dim)  # -1 heads: the local count under a plan
        q = self.q_proj(x).view(shape).transpose(1, 2)  # (B, H/tp, T, Dh)
        k = self.k_proj(x).view(shape).transpose(1, 2).repeat_interleave(self.groups, 1)
        v = self.v_proj(x).view(shape).transpose(1, 2).repeat_interleave(self.groups, 1)
        y = _causal_softmax_attention(q, k, v).transpose(1, 2)  # (B, T, H/tp, Dh)
        return self.o_proj(y.reshape(*x.shape[:-1], -1))


class LlamaMLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.ffn, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim)
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c.dim)
        self.mlp = LlamaMLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaInner(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.dim, padding_idx=0)  # as HF's, with a pad id
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaStyle(nn.Module):
    def __init__(self, c: Config = Config()) -> None:
        super().__init__()
        self.model = LlamaInner(c)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


# -- a nanoGPT-style model (karpathy/nanoGPT's module names and reshapes) ----------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.dim, 3 * c.dim)  # q, k, v fused on the out dim
        self.c_proj = nn.Linear(c.dim, c.dim)
        self.n_head, self.n_embd = c.heads, c.dim

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = _causal_softmax_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.dim, 4 * c.dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.dim)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, c: Config = Config()) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab, c.dim),
            wpe=nn.Embedding(c.seq, c.dim),
            h=nn.ModuleList(Block(c) for _ in range(c.layers)),
            ln_f=nn.LayerNorm(c.dim),
        ))
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in nanoGPT

    def forward(self, ids):
        pos = torch.arange(ids.shape[-1], device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def hf_llama(dtype=torch.float64):
    """A tiny ``transformers.LlamaForCausalLM`` (GQA), eager attention."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def hf_gpt2(dtype=torch.float64):
    """A tiny ``transformers.GPT2LMHeadModel`` (Conv1D layers, tied lm_head), no dropout."""
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


class HFLogits(nn.Module):
    """HF models return a ModelOutput: this wrapper returns the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, ids):
        return self.inner(input_ids=ids).logits


MODELS = {"llama": LlamaStyle, "nanogpt": NanoGPT,
          "hf_llama": lambda: HFLogits(hf_llama()), "hf_gpt2": lambda: HFLogits(hf_gpt2())}
PLANS = {
    "llama": tp_lib.LLAMA,
    "llama_vocab": {**tp_lib.LLAMA, "*embed_tokens.weight": "vocab", "*lm_head.weight": "vocab"},
    "nanogpt": tp_lib.NANOGPT,
    "nanogpt_mlp": {k: v for k, v in tp_lib.NANOGPT.items() if v != "vocab"},
    "gpt2": {"inner." + k: v for k, v in tp_lib.GPT2.items()},
}


def make(model: str, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[model]().to(dtype)


def tokens(n: int = BATCH, seed: int = 0, vocab: int = 64, seq: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq + 1), generator=g)


def lm_loss(logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())


# -- forward and gradients inside shard_map vs the unsharded module ------------------------------


def grads_case(model: str, plan_name: str, mesh_axes: dict, *, ref: bool = True) -> dict:
    """Logits, loss and parameter gradients (float64): the module unsharded (``ref``), and
    the plan inside ``shard_map`` (batch split over "data" when the mesh has it)."""
    module = make(model)
    tp = tp_lib.plan(module, PLANS[plan_name], axis="tensor")
    params, tok = tp.params, tokens()
    n = tok[:, 1:].numel()
    out = {}
    if ref:
        def full_loss(p):
            return lm_loss(torch.func.functional_call(module, p, (tok[:, :-1],)), tok)

        ref_grads, ref_loss = torch.func.grad_and_value(full_loss)(params)
        out["ref"] = (module(tok[:, :-1]).detach(), ref_loss, ref_grads)

    mesh = fs.Mesh(mesh_axes)
    data = "data" in mesh_axes

    def body(p, t):
        def loss(p):  # this shard's part of the global mean
            logits = tp.apply(p, t[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten(), reduction="sum") / n

        # Parameters are invariant over "data": their gradients come back summed over it
        # by the implicit pvary's transpose (and over "tensor" where they are replicated).
        g, value = torch.func.grad_and_value(loss)(p)
        return tp.apply(p, t[:, :-1]), fs.psum(value, "data") if data else value, g

    bspec = P("data") if data else P()
    f = fs.shard_map(body, mesh=mesh, in_specs=(tp.specs, bspec), out_specs=(bspec, P(), tp.specs))
    out["tp"] = f(params, tok)
    return out


def input_grad_case(mesh_axes: dict) -> dict:
    """A colwise/rowwise MLP (with biases) on a differentiated input replicated over
    "tensor": the input's gradient must be summed over the tensor shards (Megatron's f)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()
    tp = tp_lib.plan(mlp, {"0.weight": "colwise", "2.weight": "rowwise"}, axis="tensor")
    x = torch.randn(4, 8, dtype=torch.float64)

    def loss(p, x):
        return torch.func.functional_call(mlp, p, (x,)).sin().sum()

    ref = torch.func.grad(loss, argnums=(0, 1))(tp.params, x)
    data = "data" in mesh_axes
    xspec = P("data") if data else P()

    def body(p, x):
        def local(p, x):
            y = tp.apply(p, x).sin().sum()
            return y
        gp, gx = torch.func.grad(local, argnums=(0, 1))(p, x)
        return gp, gx

    f = fs.shard_map(body, mesh=fs.Mesh(mesh_axes), in_specs=(tp.specs, xspec),
                     out_specs=(tp.specs, xspec))
    return {"ref": ref, "tp": f(tp.params, x)}


# -- training: train_step (AdamW + clipping) vs a plain PyTorch loop -----------------------------


def train_plan(model: str, plan_name: str | None, mesh_axes: dict, steps: int = STEPS) -> dict:
    """``steps`` of ``train_step`` on the plan's specs (fp32); ``plan_name=None``: no
    tensor parallelism (replicated parameters)."""
    module = make(model, torch.float32)
    table = PLANS[plan_name] if plan_name else {}
    tp = tp_lib.plan(module, table, axis="tensor")

    def loss(p, batch):
        return lm_loss(tp.apply(p, batch[:, :-1]), batch)

    step = fs.train_step(loss, fs.optim.adamw(LR, weight_decay=WD), mesh=fs.Mesh(mesh_axes),
                         param_specs=tp.specs, clip=CLIP)
    state = step.init(tp.params)
    losses = []
    for i in range(steps):
        state, m = step(state, tokens(seed=i))
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": step.params(state)}


def train_plain(model: str, steps: int = STEPS) -> dict:
    """The same training as a plain module + torch.optim.AdamW + clip_grad_norm_ loop."""
    module = make(model, torch.float32)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for i in range(steps):
        tok = tokens(seed=i)
        loss = lm_loss(module(tok[:, :-1]), tok)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach() for n, p in module.named_parameters()}}


def specs_only_error(mesh_axes: dict) -> str:
    """train_step on the plan's specs with the module called without the plan."""
    module = make("llama", torch.float32)
    tp = tp_lib.plan(module, tp_lib.LLAMA, axis="tensor")

    def loss(p, batch):  # the plain module: no collectives where the roles meet
        return lm_loss(torch.func.functional_call(module, p, (batch[:, :-1],)), batch)

    step = fs.train_step(loss, fs.optim.adamw(LR), mesh=fs.Mesh(mesh_axes), param_specs=tp.specs)
    try:
        step(step.init(tp.params), tokens())
    except ValueError as e:
        return str(e)
    return ""


def gloo_cases() -> dict:
    """Everything the 4-rank test compares: data=2 x tensor=2 on real ranks."""
    import importlib.util

    mesh = {"data": 2, "tensor": 2}
    hf = {}
    if importlib.util.find_spec("transformers") is not None:
        hf = {"grads_gpt2": grads_case("hf_gpt2", "gpt2", mesh, ref=False)["tp"]}
    return {
        **hf,
        "grads_llama_vocab": grads_case("llama", "llama_vocab", mesh, ref=False)["tp"],
        "grads_nanogpt": grads_case("nanogpt", "nanogpt", mesh, ref=False)["tp"],
        "input_grad": input_grad_case(mesh)["tp"],
        "train_llama": train_plan("llama", "llama_vocab", mesh),
        "train_nanogpt": train_plan("nanogpt", "nanogpt", mesh),
        "specs_only": specs_only_error(mesh),
    }


def leaves(tree):
    return optree.tree_leaves(tree)
