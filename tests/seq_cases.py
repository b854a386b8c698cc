"""Sequence-parallel GPT training on a mesh (virtual or real ranks), and its unsharded
reference: the same global batches, the same losses and parameters (tests/test_sequence.py)."""

from __future__ import annotations

import functools

import optree
import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.parallel import sequence

STEPS = 10


def config(positions: str = "learned", kv: int | None = None, heads: int = 4) -> gpt.GPTConfig:
    return gpt.GPTConfig.small(d_model=32, n_layers=2, n_heads=heads, n_kv_heads=kv, seq_len=32, bias=False,
                               positions=positions)


def batches(cfg: gpt.GPTConfig, n: int = STEPS, rows: int = 4, *, length: int | None = None,
            multiple: int = 1) -> list[dict]:
    """``n`` batches of ``length`` (default seq_len) tokens, padded to ``multiple``."""
    g = torch.Generator().manual_seed(3)
    T = cfg.seq_len if length is None else length
    return [gpt.shift({"tokens": torch.randint(0, cfg.vocab_size, (rows, T + 1), generator=g)}, multiple=multiple)
            for _ in range(n)]


def _setup(mesh_shape: dict, strategy: str | None, layout: str, *, zero_stage: int, positions: str,
           kv: int | None, tensor: bool, heads: int, length: int | None, remat: bool, steps: int = STEPS):
    """The step, the initial parameters and the batches (laid out for ``layout``) of ``train``."""
    cfg = config(positions, kv, heads)
    params = gpt.init(cfg, 0)
    mesh = fs.Mesh(mesh_shape)
    n = mesh_shape.get("seq", 1)
    loss = functools.partial(gpt.loss, attention="einsum", block_fn=_remat if remat else None)
    # hybrid: the sequence over (seq_ring, seq), Ulysses over seq inside each ring position
    seq_axis = ("seq_ring", "seq") if strategy == "hybrid" else "seq"
    if strategy == "megatron":  # over the tensor axis, between the tensor-parallel layers
        loss = functools.partial(loss, seq_parallel="megatron")
    elif strategy is not None:
        loss = functools.partial(loss, seq_axis=seq_axis, seq_parallel=strategy, seq_layout=layout)
    specs = gpt.tensor_parallel_specs(params) if tensor else P()
    if zero_stage:
        # Over data, or over seq on a mesh without it (the ranks of a sequence group hold the
        # same parameters, as data replicas do; DeepSpeed shards ZeRO over both).
        axis = "data" if "data" in mesh_shape else "seq"
        specs = fs.parallel.zero(zero_stage, axis=axis, min_size=8)(specs, params)
    axes = tuple(a for a in ("data", "seq") if a in mesh_shape)
    batch_spec = P(axes[0] if "data" in axes else None,
                   (seq_axis if strategy is not None else "seq") if "seq" in axes else None) if axes else P()
    step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=mesh, param_specs=specs, batch_spec=batch_spec,
                         blocks="blocks", clip=1.0)
    total = n * mesh_shape.get("seq_ring", 1) if strategy not in (None, "megatron") else \
        mesh_shape.get("tensor", 1) if strategy == "megatron" else 1
    bs = batches(cfg, steps, length=length, multiple=total * (2 if layout == "zigzag" else 1))
    if layout == "zigzag":
        bs = [{k: sequence.zigzag(v, n) for k, v in b.items()} for b in bs]
    return step, params, bs


def train(mesh_shape: dict, strategy: str | None = None, layout: str = "contiguous", *, zero_stage: int = 0,
          positions: str = "learned", kv: int | None = None, tensor: bool = False, heads: int = 4,
          length: int | None = None, remat: bool = False) -> dict:
    """STEPS steps of adamw on ``mesh_shape`` (``strategy`` None: no sequence parallelism,
    the reference); losses and the final full parameters."""
    step, params, bs = _setup(mesh_shape, strategy, layout, zero_stage=zero_stage, positions=positions, kv=kv,
                              tensor=tensor, heads=heads, length=length, remat=remat)
    state = step.init(params)
    losses = []
    for b in bs:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": optree.tree_map(lambda x: x.detach().clone(), step.params(state))}


def manifests(mesh_shape: dict, strategy: str | None = None, layout: str = "contiguous", *,
              zero_stage: int = 0) -> dict:
    """The collectives one step of ``train``'s job runs, twice: recorded while it runs
    (``"ran"``) and listed by ``step.collectives`` without running (``"listed"``), each as
    ``(op, axis, phase, shape, bytes sent)``."""
    from fsharded.spmd import _manifest

    step, params, bs = _setup(mesh_shape, strategy, layout, zero_stage=zero_stage, positions="learned", kv=None,
                              tensor=False, heads=4, length=None, remat=False, steps=1)
    state = step.init(params)
    listed = step.collectives(state, bs[0])
    with _manifest.recording() as ran:
        step(state, bs[0])

    def rows(entries):
        return [(e.op, e.axis, e.phase, tuple(e.shape), e.bytes_sent) for e in entries]

    return {"ran": rows(ran), "listed": rows(listed)}


def _remat(block, p, x, **kw):
    """Each block recomputed in backward (activation checkpointing)."""
    leaves, tdef = optree.tree_flatten(p)
    run = lambda x, *ps: block(optree.tree_unflatten(tdef, list(ps)), x, **kw)  # noqa: E731
    return fs.parallel.remat.checkpoint(run)(x, *leaves)


def close(got: dict, want: dict, tol: float = 1e-5) -> None:
    """Losses within ``tol``; parameters within ``2 * tol``: Adam divides each element's
    step by its gradient's size, so an element whose gradient is near zero turns
    reduction-order rounding into a visible step (tensor parallelism alone is ~1e-5 off
    the unsharded model after 10 steps here, data parallelism ~5e-6)."""
    assert len(got["losses"]) == len(want["losses"])
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (i, a, b)
    for a, b in zip(optree.tree_leaves(got["params"]), optree.tree_leaves(want["params"])):
        torch.testing.assert_close(a, b, atol=2 * tol, rtol=tol)


def ring_attention_case(n: int, layout: str, *, B: int = 2, H: int = 4, KV: int = 2, Dh: int = 8,
                        per_shard: int = 8) -> dict:
    """Ring attention over ``Mesh({"seq": n})`` on this process's backend against causal
    attention over the whole sequence: output and gradients of q, k, v (global), the
    collectives the call ran (op, axis, phase, bytes), how many exchanges were posted in
    the background (``ppermute_start`` on real ranks) and the (query, key) pairs the
    forward's blocks computed on this shard."""
    from fsharded import comm
    from fsharded.parallel import ring
    from fsharded.spmd import _manifest

    g = torch.Generator().manual_seed(7)
    T = n * per_shard
    q = torch.randn(B, T, H, Dh, generator=g, requires_grad=True)
    k, v = (torch.randn(B, T, KV, Dh, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(B, T, H, Dh, generator=g)
    # The reference: plain causal attention, GQA heads repeated.
    rk, rv = (t.repeat_interleave(H // KV, dim=2) for t in (k, v))
    s = torch.einsum("bthd,bshd->bhts", q, rk) * Dh**-0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("bhts,bshd->bthd", s.softmax(-1), rv)
    ref_g = torch.autograd.grad((ref * w).sum(), (q, k, v))

    def zz(t):
        return sequence.zigzag(t, n) if layout == "zigzag" else t

    sm = fs.shard_map(lambda q, k, v: ring.ring_attention(q, k, v, "seq", layout=layout),
                      mesh=fs.Mesh({"seq": n}), in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    posted, work = [], []
    start, block, flash = comm.send_recv_start, ring._block, ring._flash

    def counting(*a, **kw):
        posted.append(1)
        return start(*a, **kw)

    def sized(fn):
        def run(q, k, *a):
            work.append(q.shape[1] * k.shape[1])  # (query, key) pairs computed: (B, T, heads, Dh)
            return fn(q, k, *a)
        return run

    comm.send_recv_start, ring._block, ring._flash = counting, sized(block), sized(flash)
    try:
        with _manifest.recording() as entries:
            out = sm(zz(q), zz(k), zz(v))
            if layout == "zigzag":
                out = sequence.unzigzag(out, n)
            grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    finally:
        comm.send_recv_start, ring._block, ring._flash = start, block, flash
    return {"pairs": sum(work), "out": out.detach(), "grads": [t.detach() for t in grads], "ref": ref.detach(),
            "ref_grads": [t.detach() for t in ref_g], "posted": len(posted),
            "collectives": [(e.op, e.axis, e.phase, e.bytes_sent) for e in entries]}
