"""Sequence-parallel attention on gloo ranks: fsharded's Ulysses, ring (zigzag) and hybrid
against DeepSpeed-Ulysses' ``DistributedAttention`` wrapped around the same local
attention, and against no sequence parallelism (the whole sequence on one rank).

One causal attention layer, forward and backward, batch 1, at growing sequence lengths;
every rank one thread. Reported per rank: median time, peak bytes the layer allocates
(the memory tracker, the same for both), and bytes sent (fsharded's manifest; DeepSpeed's
four all-to-alls computed: q, k, v and the output, ``(P - 1)/P`` of each sent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch

from fsharded.bench import Qty, Report, Row, Section

HEADS, HEAD_DIM = 8, 32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on (B, T, h, Dh) — the local attention every variant runs."""
    from fsharded.models.gpt import _causal_attention

    return _causal_attention(q, k, v)


def _inputs(length: int, n: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(1, length // n, HEADS, HEAD_DIM, generator=g).requires_grad_() for _ in range(3)]


def _time(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _peak(fn) -> int:
    import fsharded as fs

    with fs.memory.track() as mem:
        fn()
    return mem.peak_bytes


def _rank(lengths: Sequence[int], rounds: int, deepspeed: bool) -> dict:
    """On each rank: every variant at every length."""
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import P
    from fsharded.parallel import ring, ulysses

    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    seq = fs.Mesh({"seq": n})
    spec = P(None, "seq")
    variants = {
        "ulysses": fs.shard_map(lambda q, k, v: ulysses.ulysses_attention(_attend, q, k, v, "seq"), mesh=seq,
                                in_specs=(spec,) * 3, out_specs=spec),
        "ring": fs.shard_map(lambda q, k, v: ring.ring_attention(q, k, v, "seq", layout="zigzag"), mesh=seq,
                             in_specs=(spec,) * 3, out_specs=spec),
    }
    if n >= 4:
        hy = fs.Mesh({"seq_ring": n // 2, "seq": 2})
        hspec = P(None, ("seq_ring", "seq"))
        variants["hybrid"] = fs.shard_map(
            lambda q, k, v: ulysses.ulysses_attention(lambda q, k, v: ring.ring_attention(q, k, v, "seq_ring"),
                                                      q, k, v, "seq"),
            mesh=hy, in_specs=(hspec,) * 3, out_specs=hspec)
    ds = None
    if deepspeed:
        import logging

        from fsharded.bench.zero import _quiet_stdout

        _quiet_stdout()  # DeepSpeed's JIT build logs: stdout is the report
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed as ds_pkg
        from deepspeed.sequence.layer import DistributedAttention

        ds_pkg.utils.logger.setLevel(logging.WARNING)
        ds_pkg.init_distributed(dist_backend="gloo")  # wraps the existing gloo group

        class Local(torch.nn.Module):
            def forward(self, q, k, v, *args, **kwargs):
                return _attend(q, k, v)

        ds = DistributedAttention(Local(), dist.group.WORLD, scatter_idx=2, gather_idx=1)
    out: dict = {}
    for L in lengths:
        q, k, v = _inputs(L, n, rank)
        grad = torch.ones(1, L // n, HEADS, HEAD_DIM)
        rec: dict = {}

        def step(f, q=q, k=k, v=v, grad=grad):
            def run():
                f(q, k, v).backward(grad)
                q.grad = k.grad = v.grad = None
            return run

        fns = {name: step(sm.local) for name, sm in variants.items()}
        if ds is not None:
            fns["deepspeed"] = step(lambda q, k, v: ds(q, k, v, 0))
        if rank == 0:  # no sequence parallelism: the whole sequence here
            qf, kf, vf = (torch.randn(1, L, HEADS, HEAD_DIM).requires_grad_() for _ in range(3))
            gf = torch.ones(1, L, HEADS, HEAD_DIM)

            def whole(qf=qf, kf=kf, vf=vf, gf=gf):
                _attend(qf, kf, vf).backward(gf)
                qf.grad = kf.grad = vf.grad = None
        for name, fn in fns.items():
            fn()  # warm
            dist.barrier()
            rec[name] = {"t": _time(fn, rounds), "peak": _peak(fn)}
            dist.barrier()
        whole_shape = [torch.empty(1, L, HEADS, HEAD_DIM) for _ in range(3)]  # collectives() takes global values
        for name, sm in variants.items():
            rec[name]["sent"] = sm.collectives(*whole_shape).total_bytes()
        if ds is not None:
            rec["deepspeed"]["sent"] = 4 * (q.numel() * 4) * (n - 1) // n  # q, k, v, out: (P-1)/P sent
        if rank == 0:
            whole()
            rec["none"] = {"t": _time(whole, max(1, rounds // 2)), "peak": _peak(whole)}
        dist.barrier()
        out[L] = rec
    return out


def run(world: int, lengths: Sequence[int], rounds: int, deepspeed: bool) -> Report:
    from fsharded.testing import run_on_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_rank = run_on_ranks(_rank, world, list(lengths), rounds, deepspeed)
    r0 = per_rank[0]
    report = Report("seq", params={"torch": torch.__version__, "ranks": world,
                                   "layer": f"causal attention, {HEADS} heads x {HEAD_DIM}, batch 1, fwd + bwd"})
    variants = [v for v in ("ulysses", "ring", "hybrid") if v in r0[lengths[0]]]

    def slowest(L, name):  # a step takes as long as its slowest rank
        return max(statistics.median(r[L][name]["t"]) for r in per_rank)

    if deepspeed:
        rows = tuple(Row(f"{v} vs DeepSpeed-Ulysses", f"{L} tokens", slowest(L, v), slowest(L, "deepspeed"))
                     for L in lengths for v in variants)
        report.sections.append(Section(f"step time on {world} ranks (slowest rank)", "deepspeed.sequence."
                                       "layer.DistributedAttention around the same local attention", rows,
                                       target=1.0))
        rows = tuple(Qty(f"{v} vs DeepSpeed-Ulysses", f"{L} tokens", max(r[L][v]["peak"] for r in per_rank),
                         max(r[L]["deepspeed"]["peak"] for r in per_rank), unit="B")
                     for L in lengths for v in variants)
        report.sections.append(Section("peak bytes the layer allocates per rank", "DeepSpeed-Ulysses", rows))
    rows = tuple(Row(f"{v} vs one rank, whole sequence", f"{L} tokens", slowest(L, v), r0[L]["none"]["t"][0]
                     if len(r0[L]["none"]["t"]) == 1 else statistics.median(r0[L]["none"]["t"]))
                 for L in lengths for v in variants)
    report.sections.append(Section("step time against no sequence parallelism", "the whole sequence on one rank",
                                   rows, notes=(f"ideal: 1/{world} of the compute, plus the exchange",)))
    rows = tuple(Qty(f"{v} vs one rank, whole sequence", f"{L} tokens", max(r[L][v]["peak"] for r in per_rank),
                     r0[L]["none"]["peak"], unit="B") for L in lengths for v in variants)
    report.sections.append(Section("peak activation bytes per rank against no sequence parallelism",
                                   "the whole sequence on one rank", rows,
                                   notes=(f"about 1/{world} expected for the linear parts; the causal "
                                          "scores are (T/P) x T per head in every variant",)))
    rows = tuple(Qty(f"{v} bytes sent per rank", f"{L} tokens", max(r[L][v]["sent"] for r in per_rank),
                     max(r[L]["deepspeed"]["sent"] for r in per_rank) if deepspeed else float("nan"), unit="B")
                 for L in lengths for v in variants)
    report.sections.append(Section("bytes sent per rank per layer (fwd)", "DeepSpeed-Ulysses (4 all-to-alls)", rows))
    report.finish()
    return report


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench seq", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short sequences, few rounds (a smoke run)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2; 4 adds the hybrid)")
    p.add_argument("--lengths", default="1024,4096", help="comma-separated sequence lengths")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed (compared where installed)")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    lengths = [256] if args.quick else [int(x) for x in args.lengths.split(",")]
    chunks = 2 * args.ranks
    bad = [L for L in lengths if L % chunks]
    if bad:
        raise SystemExit(f"fsharded bench seq: lengths must divide by 2 x ranks = {chunks} (zigzag): {bad}")
    with_ds = not args.no_deepspeed
    if with_ds:
        try:
            import deepspeed.sequence.layer  # noqa: F401
        except Exception:  # noqa: BLE001 - not installed or not importable here
            with_ds = False
    report = run(args.ranks, lengths, 2 if args.quick else args.rounds, with_ds)
    report.print(markdown=args.markdown)
    return 0
