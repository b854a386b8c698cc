"""Hugging Face decoders trained with their sequence sharded through
``fs.nn.sequence_parallel``, and the stock model (its own eager attention) trained unsharded
the same way: the same global batches, so the same losses and weights
(tests/test_nn_sequence.py). Module-level functions: ``run_on_ranks`` imports them by name."""

from __future__ import annotations

import model_zoo as Z
import optree
import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import P

STEPS, ROWS, SEQ, LR = 5, 4, 32, 3e-3


def build(kind: str, **overrides) -> torch.nn.Module:
    """Tiny models from a config (no weights downloaded), eager attention, no KV cache."""
    if kind == "llama":  # 2 layers, hidden 32, 4 heads, 2 kv heads (GQA), rotary positions
        return Z.hf_llama(0, **overrides)
    if kind == "gpt2":  # learned positions, 4 heads so Ulysses reaches degree 4
        return Z.hf_gpt2(0, **{"n_head": 4, "n_positions": 64, **overrides})
    if kind == "mistral":  # Llama's layout with a sliding window shorter than the sequence
        import transformers

        cfg = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   sliding_window=8, use_cache=False, attn_implementation="eager")
        torch.manual_seed(0)
        return transformers.MistralForCausalLM(transformers.MistralConfig(**{**cfg, **overrides}))
    raise ValueError(kind)


def batches(n: int = STEPS, length: int = SEQ) -> list[dict]:
    """``{"tokens": (ROWS, length + 1)}`` drawn from a pool of 8 sequences: memorisable, so
    the loss falls within a few steps and a wrong update shows."""
    g = torch.Generator().manual_seed(5)
    pool = torch.randint(0, 256, (8, length + 1), generator=g)
    return [{"tokens": pool[torch.randint(0, 8, (ROWS,), generator=g)]} for _ in range(n)]


def shifted(b: dict) -> dict:
    return {"inputs": b["tokens"][:, :-1], "targets": b["tokens"][:, 1:].contiguous()}


def reference_loss(fm: fs.nn.FunctionalModule):
    def loss(params, batch):
        logits = fm.apply(params, input_ids=batch["inputs"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    return loss


def train(kind: str, mesh_shape: dict | None = None, strategy: str | None = None, layout: str = "contiguous",
          *, zero_stage: int = 0, steps: int = STEPS, length: int = SEQ) -> dict:
    """``steps`` AdamW steps (clipped); ``strategy`` None: the stock model, unsharded (the
    reference). ``length`` tokens per row (padded by ``prepare`` to divide over the shards).
    Losses and the final full parameters."""
    model = build(kind)
    if strategy is None:
        fm = fs.nn.functional(model)
        mesh, loss, params, blocks = fs.Mesh({"data": 1}), reference_loss(fm), fm.params, fm.blocks
        batch_spec, prepare = P("data"), shifted
    else:
        axis = ("seq_ring", "seq") if strategy == "hybrid" else "seq"
        sp = fs.nn.sequence_parallel(model, axis=axis, strategy=strategy, layout=layout)
        mesh, loss, params, blocks = fs.Mesh(mesh_shape), sp.loss, sp.params, sp.blocks
        batch_spec = sp.batch_spec("data" if "data" in mesh_shape else None)

        def prepare(b):
            return sp.prepare(b, mesh)
    specs = P()
    if zero_stage:
        # Over data, or over seq on a mesh without it (a sequence group's ranks hold the same
        # parameters, as data replicas do).
        specs = fs.parallel.zero(zero_stage, axis="data" if "data" in mesh.shape else "seq", min_size=8)(
            specs, params)
    step = fs.train_step(loss, fs.optim.adamw(LR, weight_decay=0.1), mesh=mesh, param_specs=specs,
                         batch_spec=batch_spec, blocks=blocks, clip=1.0)
    state = step.init(params)
    losses = []
    for b in batches(steps, length):
        state, m = step(state, prepare(b))
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": optree.tree_map(lambda x: x.detach().clone(), step.params(state))}


def forward_and_grads(kind: str, strategy: str, n: int, layout: str = "contiguous") -> dict:
    """Logits and the gradient of the loss on ``Mesh({"seq": n})`` (global, in sequence
    order) and those of the stock model on the whole sequence."""
    batch = batches(1)[0]
    ref = build(kind)
    fm = fs.nn.functional(ref)
    b = shifted(batch)
    ref_logits = ref(input_ids=b["inputs"]).logits.detach()
    ref_g = torch.func.grad(reference_loss(fm))(fm.params, b)
    sp = fs.nn.sequence_parallel(build(kind), strategy=strategy, layout=layout)
    mesh = fs.Mesh({"seq": n})
    pb = sp.prepare(batch, mesh)
    logits = fs.shard_map(lambda p, x: sp.apply(p, x).logits, mesh=mesh, in_specs=(P(), P(None, "seq")),
                          out_specs=P(None, "seq"))(sp.params, pb["inputs"])
    loss = fs.shard_map(lambda p, b: fs.pmean(sp.loss(p, b), "seq"), mesh=mesh, in_specs=(P(), P(None, "seq")),
                        out_specs=P())
    g = torch.func.grad(loss)(sp.params, pb)
    return {"logits": sp.restore(logits, mesh).detach(), "ref_logits": ref_logits,
            "grads": optree.tree_leaves(g), "ref_grads": optree.tree_leaves(ref_g)}


def gloo_runs() -> dict:
    """On each of 2 gloo ranks: ring attention (zigzag, its real-rank path: blocks cut to
    their visible part, transfers overlapped) and Ulysses at ZeRO-3 over the seq axis."""
    torch.set_num_threads(1)
    return {"ring": train("llama", {"seq": 2}, "ring", "zigzag"),
            "ulysses_zero3": train("llama", {"seq": 2}, "ulysses", zero_stage=3)}
