"""Pipeline executor cases run on gloo ranks (``fsharded.testing.run_on_ranks``)."""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

from fsharded.models import gpt, gpt_stages
from fsharded.parallel import pipeline as pp


def setup(layers: int = 4, batch: int = 8, seed: int = 0, **cfg):
    """The tiny GPT, its parameters and a batch: the same on every rank and in the test."""
    config = gpt.GPTConfig.tiny(n_layers=layers, **cfg)
    params = gpt.init(config, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=g)
    return params, tokens


def micro_batches(tokens: torch.Tensor, m: int) -> list[dict]:
    return [{"tokens": t} for t in tokens.chunk(m)]


def leaves_requiring_grad(tree):
    return optree.tree_map(lambda t: t.detach().clone().requires_grad_(), tree)


def run_rank(name: str, p: int, v: int, m: int, untied: bool = False) -> dict:
    """This rank's part of a pipelined gradient: its stages' gradients and, on the last
    stage's rank, the loss."""
    params, tokens = setup(tied_embeddings=False) if untied else setup()
    sched = pp.make(name, p, m, v)
    stages = gpt_stages.pipeline_stages(params, p * v, attention="einsum")
    me = dist.get_rank()
    mine = [s for s in range(stages.n) if sched.rank_of(s) == me]
    parts = {s: leaves_requiring_grad(stages.params_of(params, s)) for s in mine}
    res = pp.run(sched, stages, parts, micro_batches(tokens, m), ranks=[me],
                 transport=pp.PointToPoint(dist.group.WORLD, list(range(dist.get_world_size())), m))
    return {"grads": {s: optree.tree_map(torch.Tensor.detach, g) for s, g in res.grads.items()},
            "loss": None if res.loss is None else res.loss.detach(), "peak": res.peak_held[me]}
