"""``fsharded bench nn``: a user's own ``nn.Module`` trained through ``fs.nn.functional``.

    fsharded bench nn             # nanoGPT-style GPT (~0.9 M params), batch 16x128, fp32
    fsharded bench nn --quick     # tiny shapes, a smoke run
    fsharded bench nn --markdown

The model is written the way nanoGPT writes it (a ``ModuleList`` of blocks with a fused
qkv projection, tied embeddings), not as a pure function. Section 1, one process:
``train_step`` on ``fs.nn.functional(model)`` against the eager loop on the module itself
(``loss.backward()``, ``clip_grad_norm_``, ``torch.optim.AdamW``). Section 2, 2 gloo
ranks: ZeRO-3 through ``fs.nn`` (``blocks=fm.blocks``: gathered block by block) against
FSDP2 (``fully_shard`` on each block and the root of the same module). Rounds alternate;
each pair is first checked to train to the same loss.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import fsharded as fs
from fsharded.bench import Report, Row, Section, add_output_args, alternate


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- a nanoGPT-style model ----------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    seq: int = 128
    d: int = 128
    heads: int = 4
    layers: int = 4


class _Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c_attn = nn.Linear(c.d, 3 * c.d)
        self.c_proj = nn.Linear(c.d, c.d)
        self.heads = c.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class _Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.d), _Attention(c)
        self.ln_2 = nn.LayerNorm(c.d)
        self.mlp = nn.Sequential(nn.Linear(c.d, 4 * c.d), nn.GELU(), nn.Linear(4 * c.d, c.d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout: ``transformer.{wte, wpe, h, ln_f}`` and a tied ``lm_head``."""

    def __init__(self, c: Config):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab, c.d), wpe=nn.Embedding(c.seq, c.d),
            h=nn.ModuleList(_Block(c) for _ in range(c.layers)), ln_f=nn.LayerNorm(c.d)))
        self.lm_head = nn.Linear(c.d, c.vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def build(c: Config, seed: int = 0) -> NanoGPT:
    torch.manual_seed(seed)
    return NanoGPT(c)


def _ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _fs_step(c: Config, mesh: fs.Mesh, stage: int, lr: float, clip: float):
    fm = fs.nn.functional(build(c))

    def loss(params, batch):
        return _ce(fm.apply(params, batch["tokens"][:, :-1]), batch["tokens"])

    specs = fs.parallel.zero(stage)(fs.P(), fm.params) if stage else fs.P()
    step = fs.train_step(loss, fs.optim.adamw(lr, weight_decay=0.0), mesh=mesh, param_specs=specs,
                         blocks=fm.blocks, clip=clip, donate=True)
    return step, step.init(fm.params)


class _Eager:
    """The module trained as its authors do: backward, clip_grad_norm_, AdamW."""

    def __init__(self, model: nn.Module, lr: float, clip: float):
        self.model, self.clip = model, clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=True)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = _ce(self.model(tokens[:, :-1]), tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _batches(c: Config, batch: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, c.vocab, (batch, c.seq + 1), generator=g) for _ in range(n)]


def _agree(a: list[float], b: list[float], case: str) -> None:
    # fp32, a few steps, another summation order: ~1e-6 relative.
    err = max(abs(x - y) for x, y in zip(a, b))
    if err > 1e-3:
        raise RuntimeError(f"{case}: losses differ from the peer's by {err:.3g}")


# -- section 1: one process ---------------------------------------------------------------


def one_process(c: Config, batch: int, rounds: int, iters: int) -> Section:
    lr, clip = 1e-3, 1.0
    data = _batches(c, batch, 3 + iters)
    step, state = _fs_step(c, fs.Mesh({"data": 1}), 0, lr, clip)
    eager = _Eager(build(c), lr, clip)
    ours_l, peer_l = [], []
    for t in data[:3]:
        state, m = step(state, {"tokens": t})
        ours_l.append(float(m["loss"]))
        peer_l.append(float(eager(t)))
    _agree(ours_l, peer_l, "one process")
    box = {"state": state}

    def ours() -> float:
        t0 = time.perf_counter()
        for t in data[3:]:
            box["state"], m = step(box["state"], {"tokens": t})
        float(m["loss"])
        return (time.perf_counter() - t0) / iters

    def peer() -> float:
        t0 = time.perf_counter()
        for t in data[3:]:
            loss = eager(t)
        float(loss)
        return (time.perf_counter() - t0) / iters

    a, p = alternate(ours, peer, rounds)
    row = Row.from_samples("fs.nn.functional + train_step vs the module's eager loop", f"{batch}x{c.seq}", a, p)
    _log(f"  {row.case}: ratio {row.ratio:.2f}")
    return Section(
        title=f"one optimizer step of a nanoGPT-style nn.Module ({_count(c):,} params, fp32), one process",
        peer="the same module: loss.backward(), clip_grad_norm_, torch.optim.AdamW(foreach)",
        rows=(row,), target=1.05,
        notes=(f"{rounds} alternating rounds of {iters} steps; ours donates its state (in place, "
               f"as torch.optim updates); the first 3 steps' losses checked to agree",))


def _count(c: Config) -> int:
    return sum(p.numel() for p in build(c).parameters())


# -- section 2: 2 gloo ranks --------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    config: Config
    batch: int  # sequences per rank
    rounds: int
    iters: int


def rank_worker(job: Job) -> dict:
    """ZeRO-3 through fs.nn and FSDP2 on the same module, alternating on these ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    c, world = job.config, dist.get_world_size()
    lr, clip = 1e-3, 1.0
    data = _batches(c, job.batch * world, 3 + job.rounds * job.iters)
    me = slice(dist.get_rank() * job.batch, (dist.get_rank() + 1) * job.batch)
    step, state = _fs_step(c, fs.Mesh({"data": world}), 3, lr, clip)
    model = build(c)
    dm = init_device_mesh("cpu", (world,))
    for b in model.transformer.h:
        fully_shard(b, mesh=dm)
    fully_shard(model, mesh=dm)
    fsdp = _Eager(model, lr, clip)
    box = {"state": state}

    def ours(ts) -> float:
        for t in ts:
            box["state"], m = step(box["state"], {"tokens": t})
        return float(m["loss"])

    def peer(ts) -> float:
        for t in ts:
            loss = fsdp(t[me])
        # FSDP2's loss is this rank's: average it as ours reports the global mean.
        loss = loss.clone()
        dist.all_reduce(loss)
        return float(loss) / world

    ours_l = [ours([t]) for t in data[:3]]
    peer_l = [peer([t]) for t in data[:3]]
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for rd in range(job.rounds):
        chunk = data[3 + rd * job.iters:3 + (rd + 1) * job.iters]
        order = (("ours", ours), ("peer", peer)) if rd % 2 == 0 else (("peer", peer), ("ours", ours))
        for name, fn in order:
            dist.barrier()
            t0 = time.perf_counter()
            fn(chunk)
            times[name].append((time.perf_counter() - t0) / job.iters)
    return {"times": times, "ours_losses": ours_l, "peer_losses": peer_l}


def two_ranks(c: Config, batch: int, rounds: int, iters: int) -> Section:
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    res = run_on_ranks(rank_worker, 2, Job(c, batch, rounds, iters))
    _agree(res[0]["ours_losses"], res[0]["peer_losses"], "2 ranks")
    # A step ends when the slower rank ends: the max over ranks of each round.
    a = [max(r["times"]["ours"][i] for r in res) for i in range(rounds)]
    p = [max(r["times"]["peer"][i] for r in res) for i in range(rounds)]
    row = Row.from_samples("ZeRO-3 via fs.nn (blocks=fm.blocks) vs FSDP2 fully_shard", f"{batch}x{c.seq} per rank", a, p)
    _log(f"  {row.case}: ratio {row.ratio:.2f}")
    return Section(
        title=f"one ZeRO-3 step of a nanoGPT-style nn.Module ({_count(c):,} params, fp32), 2 gloo ranks",
        peer="FSDP2: fully_shard on each block and the root of the same module, torch.optim.AdamW",
        rows=(row,), target=1.0,
        notes=(f"{rounds} alternating rounds of {iters} steps, 1 torch thread per rank; the first "
               f"3 steps' losses checked to agree",))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench nn", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, few rounds (a smoke run)")
    add_output_args(p)
    p.add_argument("--rounds", type=int, help="alternating rounds")
    p.add_argument("--no-ranks", action="store_true", help="skip the 2-rank FSDP2 section")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.quick:
        c, batch, rounds, iters = Config(seq=32, d=32, heads=2, layers=2), 4, 2, 2
    else:
        c, batch, rounds, iters = Config(), 16, 7, 5
    rounds = args.rounds or rounds
    report = Report("nn", params={"torch": torch.__version__, "model": f"nanoGPT-style d={c.d} layers={c.layers} "
                                  f"heads={c.heads} vocab={c.vocab} seq={c.seq}, {_count(c):,} params"})
    _log("one process ...")
    report.sections.append(one_process(c, batch, rounds, iters))
    if not args.no_ranks:
        _log("2 gloo ranks ...")
        report.sections.append(two_ranks(c, max(1, batch // 2), rounds, iters))
    report.finish()
    report.emit(args)
    return 0 if math.isfinite(report.sections[0].rows[0].ratio) else 1
