"""Sequence-parallel attention on gloo ranks: fsharded's Ulysses, ring (zigzag) and hybrid
against DeepSpeed-Ulysses' ``DistributedAttention`` wrapped around the same local
attention, and against no sequence parallelism (the whole sequence on one rank).

One causal attention layer, forward and backward, batch 1, at growing sequence lengths;
every rank one thread. Reported per rank: median time, peak bytes (the memory tracker, the
same for both: the rank's inputs q, k, v and the output's gradient, and what the layer
allocates), and bytes sent (fsharded's manifest; DeepSpeed's
four all-to-alls computed: q, k, v and the output, ``(P - 1)/P`` of each sent).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Sequence

import torch

from fsharded.bench import Qty, Report, Row, Section, add_output_args, format_bytes

HEADS, HEAD_DIM = 8, 32


ATTENTION = ("flash", "einsum")


def _local(name: str):
    """Causal attention on (B, T, h, Dh), the local attention Ulysses, DeepSpeed's wrapper
    and the whole-sequence run share: ``"flash"``, ``fsharded.kernels.flash_attention``
    (torch's fused flash kernel on CPU: no (T, T) scores kept), or ``"einsum"``, the
    explicit-scores form (O(T^2) memory per head)."""
    from fsharded.models.gpt import _causal_attention, _flash_attention

    return {"flash": _flash_attention, "einsum": _causal_attention}[name]


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


def _peak(fn, inputs: Sequence[torch.Tensor]) -> int:
    """Peak bytes of ``fn()`` on this rank: its ``inputs`` (q, k, v and the output's
    gradient, allocated before: what the rank holds to run the layer) and what it allocates."""
    import fsharded as fs

    with fs.memory.track() as mem:
        mem.register(list(inputs), "activations")
        fn()
    return mem.peak_bytes


def _dry_peak(fn, length: int, n: int) -> int:
    """Peak bytes ``fn`` (a variant's per-rank call, or the whole sequence with n=1) would
    allocate per rank at ``length`` tokens: one forward and backward on meta tensors, the
    collectives answering locally (a dry run), counted by the memory tracker."""
    import fsharded as fs
    from fsharded.spmd import _manifest

    q, k, v = (torch.empty(1, length // n, HEADS, HEAD_DIM, device="meta", requires_grad=True) for _ in range(3))
    dout = torch.empty(1, length // n, HEADS, HEAD_DIM, device="meta")
    with _manifest.recording(dry=True), fs.memory.track(include_meta=True) as mem:
        mem.register([q, k, v, dout], "activations")  # held by the rank, as _peak counts them
        fn(q, k, v).backward(dout)
    return mem.peak_bytes


def _longest(fn, n: int, budget: int, quantum: int, cap: int) -> int:
    """The longest multiple of ``quantum`` tokens (up to ``cap``) whose dry-run peak per
    rank fits in ``budget`` bytes (0 if none does)."""
    lo, hi = 0, quantum
    while hi <= cap and _dry_peak(fn, hi, n) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, cap + quantum)
    while hi - lo > quantum:  # lo fits, hi does not (or is past the cap)
        mid = (lo + hi) // 2 // quantum * quantum
        lo, hi = (mid, hi) if _dry_peak(fn, mid, n) <= budget else (lo, mid)
    return lo


def rounds_at(length: int, rounds: int) -> int:
    """Timed rounds at ``length`` tokens: ``rounds`` from 4096 up, more below (up to 4x at
    1024 and shorter), where a step is short and the machine's noise a larger part of it."""
    return rounds * max(1, min(4, 4096 // max(1, length)))


def _rank(lengths: Sequence[int], rounds: int, deepspeed: bool, budget: int = 0, attention: str = "flash") -> dict:
    """On each rank: every variant at every length; with ``budget``, the longest sequence
    each fits in it per rank."""
    _attend = _local(attention)
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
        for fn in fns.values():
            fn()  # warm
        rec.update({name: {"t": []} for name in fns})
        names = list(fns)
        for r in range(rounds_at(L, rounds)):  # rounds alternate the variants, the first one rotating, so
            for name in names[r % len(names):] + names[:r % len(names)]:  # drifts in the
                dist.barrier()                                            # machine's load hit
                rec[name]["t"] += _time(fns[name], 1)                     # them all alike
        for name, fn in fns.items():
            dist.barrier()
            rec[name]["peak"] = _peak(fn, (q, k, v, grad))
        dist.barrier()
        whole_shape = [torch.empty(1, L, HEADS, HEAD_DIM) for _ in range(3)]  # collectives() takes global values
        for name, sm in variants.items():
            rec[name]["sent"] = sm.collectives(*whole_shape).total_bytes()
        if ds is not None:
            rec["deepspeed"]["sent"] = 4 * (q.numel() * 4) * (n - 1) // n  # q, k, v, out: (P-1)/P sent
        if rank == 0:
            whole()
            rec["none"] = {"t": _time(whole, max(1, rounds // 2)), "peak": _peak(whole, (qf, kf, vf, gf))}
        dist.barrier()
        out[L] = rec
    if budget:
        quantum, cap = 2 * n * 64, 1 << 22
        out["longest"] = {name: _longest(sm.local, n, budget, quantum, cap) for name, sm in variants.items()}
        out["longest"]["none"] = _longest(_attend, 1, budget, quantum, cap)
    return out


# --------------------------------------------------------------------------- a small GPT

GPT_LAYERS, GPT_D = 2, HEADS * HEAD_DIM
_ACTIVATIONS = ("activations", "comm buffers")  # the train step labels its parameters, gradients, optimizer state


def _gpt_config(length: int):
    from fsharded.models import gpt

    return gpt.GPTConfig.small(vocab_size=256, d_model=GPT_D, n_layers=GPT_LAYERS, n_heads=HEADS, seq_len=length,
                               positions="rotary", bias=False, norm="rmsnorm", activation="swiglu")


def _gpt_batch(length: int, vocab: int, multiple: int, zigzag: int = 0) -> dict:
    from fsharded.models import gpt
    from fsharded.parallel import sequence

    g = torch.Generator().manual_seed(length)
    b = gpt.shift({"tokens": torch.randint(0, vocab, (1, length + 1), generator=g)}, multiple=multiple)
    return {k: sequence.zigzag(v, zigzag) for k, v in b.items()} if zigzag else b


def _gpt_step(n: int, variant: str, attention: str, length: int):
    """(train step, state, global batch) of the small GPT on ``n`` ranks for ``variant``
    ("ulysses", "ring" zigzag, "hybrid", or "none": one process, the whole sequence)."""
    import functools

    import fsharded as fs
    from fsharded import P
    from fsharded.models import gpt

    cfg = _gpt_config(length)
    kw: dict = {}
    if variant == "none":
        mesh, spec = fs.Mesh({"seq": 1}), P()
    elif variant == "hybrid":
        mesh, spec = fs.Mesh({"seq_ring": n // 2, "seq": 2}), P(None, ("seq_ring", "seq"))
        kw = dict(seq_axis=("seq_ring", "seq"), seq_parallel="hybrid")
    else:
        mesh, spec = fs.Mesh({"seq": n}), P(None, "seq")
        kw = dict(seq_axis="seq", seq_parallel=variant, seq_layout="zigzag" if variant == "ring" else "contiguous")
    loss = functools.partial(gpt.loss, attention=attention, **kw)
    step = fs.train_step(loss, fs.optim.adamw(1e-4), mesh=mesh, batch_spec=spec)
    zz = n if variant == "ring" else 0
    return step, step.init(gpt.init(cfg, 0)), _gpt_batch(length, cfg.vocab_size, 2 * n, zz)


def _ds_ulysses(attend, q, k, v, axis):
    """DeepSpeed-Ulysses' ``DistributedAttention`` around ``attend`` over the world group:
    the peer's wrapper in place of ``ulysses_attention`` in the same GPT."""
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    class Local(torch.nn.Module):
        def forward(self, q, k, v, *args, **kwargs):
            return attend(q, k, v)

    return DistributedAttention(Local(), dist.group.WORLD, scatter_idx=2, gather_idx=1)(q, k, v, 0)


def _rank_gpt(lengths: Sequence[int], rounds: int, deepspeed: bool, attention: str) -> dict:
    """On each rank: a train step of the small GPT for every variant and length, timed
    alternately as in ``_rank``; DeepSpeed's variant is our Ulysses GPT with
    ``DistributedAttention`` in place of ``ulysses_attention``."""
    from unittest import mock

    import torch.distributed as dist

    import fsharded as fs
    from fsharded.parallel import ulysses

    torch.set_num_threads(1)
    n = dist.get_world_size()
    names = ["ulysses", "ring"] + (["hybrid"] if n >= 4 else []) + (["deepspeed"] if deepspeed else [])
    if deepspeed:
        import logging

        from fsharded.bench.zero import _quiet_stdout

        _quiet_stdout()
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed as ds_pkg

        ds_pkg.utils.logger.setLevel(logging.WARNING)
        ds_pkg.init_distributed(dist_backend="gloo")
    out: dict = {}
    for L in lengths:
        runs = {}
        for name in names:
            step, state, batch = _gpt_step(n, "ulysses" if name == "deepspeed" else name, attention, L)
            patch = mock.patch.object(ulysses, "ulysses_attention", _ds_ulysses) if name == "deepspeed" else None
            runs[name] = [step, state, batch, patch]

        def call(name, runs=runs):
            step, state, batch, patch = runs[name]
            with patch if patch is not None else contextlib.nullcontext():
                state, metrics = step(state, batch)
                runs[name][1] = state
            return float(metrics["loss"])

        rec = {name: {"t": [], "loss": call(name)} for name in names}  # warm
        for r in range(rounds_at(L, rounds)):
            for name in names[r % len(names):] + names[:r % len(names)]:
                dist.barrier()
                t0 = time.perf_counter()
                call(name)
                rec[name]["t"].append(time.perf_counter() - t0)
        for name in names:
            dist.barrier()
            with fs.memory.track() as mem:
                call(name)
            rec[name]["peak"] = mem.peak_of(_ACTIVATIONS)
            if name != "deepspeed":
                step, state, batch, _ = runs[name]
                manifest = step.collectives(state, batch)
                rec[name]["sent"] = manifest.total_bytes()
                rec[name]["a2a"] = sum(e.bytes_sent for e in manifest if e.op == "all_to_all")
        if deepspeed:  # our Ulysses' program with DeepSpeed's 4 all-to-alls per attention, fwd and bwd
            q_bytes = L // n * HEADS * HEAD_DIM * 4
            u = rec["ulysses"]
            rec["deepspeed"]["sent"] = u["sent"] - u["a2a"] + GPT_LAYERS * 2 * 4 * q_bytes * (n - 1) // n
        runs.clear()  # this length's states freed before the next
        out[L] = rec
    return out


def _rank_gpt_whole(lengths: Sequence[int], rounds: int, attention: str) -> dict:
    """The whole sequence in one process: the same GPT's train step, no sequence parallelism."""
    import fsharded as fs

    torch.set_num_threads(1)
    out = {}
    for L in lengths:
        step, state, batch = _gpt_step(1, "none", attention, L)
        state, m = step(state, batch)
        first = float(m["loss"])
        t = []
        for _ in range(max(1, rounds_at(L, rounds) // 2)):
            t0 = time.perf_counter()
            state, m = step(state, batch)
            t.append(time.perf_counter() - t0)
        with fs.memory.track() as mem:
            state, m = step(state, batch)
        out[L] = {"t": t, "peak": mem.peak_of(_ACTIVATIONS), "loss": first}
    return out


def run_gpt(world: int, lengths: Sequence[int], rounds: int, deepspeed: bool, attention: str = "flash") -> Report:
    from fsharded.testing import run_on_new_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_rank = run_on_new_ranks(_rank_gpt, world, list(lengths), rounds, deepspeed, attention)
    whole = run_on_new_ranks(_rank_gpt_whole, 1, list(lengths), rounds, attention)[0]
    r0 = per_rank[0]
    report = Report("seq", params={"torch": torch.__version__, "ranks": world, "model": (
        f"GPT d_model={GPT_D} layers={GPT_LAYERS} heads={HEADS}x{HEAD_DIM} rotary, batch 1, adamw train step"),
        "local attention": attention})
    variants = [v for v in ("ulysses", "ring", "hybrid") if v in r0[lengths[0]]]

    def slowest(L, name):
        return max(statistics.median(r[L][name]["t"]) for r in per_rank)

    if deepspeed:
        rows = tuple(Row(f"{v} vs DeepSpeed-Ulysses", f"{L} tokens", slowest(L, v), slowest(L, "deepspeed"))
                     for L in lengths for v in variants)
        report.sections.append(Section(
            f"GPT train step on {world} ranks (slowest rank)", "the same GPT with deepspeed.sequence.layer."
            "DistributedAttention in place of ulysses_attention", rows, target=1.0,
            notes=("median per rank, the variants alternating within each round; a step takes its slowest "
                   "rank's median",)))
    rows = tuple(Row(f"{v} vs one process, whole sequence", f"{L} tokens", slowest(L, v),
                     statistics.median(whole[L]["t"])) for L in lengths for v in variants)
    report.sections.append(Section("GPT train step against no sequence parallelism",
                                   "the whole sequence in one process", rows,
                                   notes=(f"ideal: 1/{world} of the compute, plus the exchange",)))
    rows = tuple(Qty(f"{v} bytes sent per rank", f"{L} tokens", max(r[L][v]["sent"] for r in per_rank),
                     max(r[L]["deepspeed"]["sent"] for r in per_rank) if deepspeed else float("nan"), unit="B")
                 for L in lengths for v in variants)
    report.sections.append(Section("bytes sent per rank per train step (forward, backward, gradient sync)",
                                   "DeepSpeed-Ulysses' four all-to-alls per attention in our Ulysses' program",
                                   rows))
    rows = tuple(Qty(f"{v} vs one process, whole sequence", f"{L} tokens", max(r[L][v]["peak"] for r in per_rank),
                     whole[L]["peak"], unit="B") for L in lengths for v in variants)
    if deepspeed:
        rows += tuple(Qty(f"{v} vs DeepSpeed-Ulysses", f"{L} tokens", max(r[L][v]["peak"] for r in per_rank),
                          max(r[L]["deepspeed"]["peak"] for r in per_rank), unit="B")
                      for L in lengths for v in variants)
    names = variants + (["deepspeed"] if deepspeed else [])
    worst = max(abs(r[L][v]["loss"] - whole[L]["loss"]) for r in per_rank for L in lengths for v in names)
    report.sections.append(Section("peak activation and communication bytes of a GPT train step per rank",
                                   "as named", rows, notes=(
        f"about 1/{world} of the whole sequence's expected; the memory tracker's activation and comm-buffer "
        "categories (the step's parameters, gradients and optimizer state are the same in every variant)",
        f"first-step losses equal the whole sequence's to {worst:.1e}")))
    report.finish()
    return report


def run(world: int, lengths: Sequence[int], rounds: int, deepspeed: bool, budget: int = 0,
        plot: str | None = None, attention: str = "flash") -> Report:
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_rank = run_on_ranks(_rank, world, list(lengths), rounds, deepspeed, budget, attention)
    r0 = per_rank[0]
    report = Report("seq", params={"torch": torch.__version__, "ranks": world,
                                   "layer": f"causal attention, {HEADS} heads x {HEAD_DIM}, batch 1, fwd + bwd",
                                   "local attention": attention})
    variants = [v for v in ("ulysses", "ring", "hybrid") if v in r0[lengths[0]]]

    def slowest(L, name):  # a step takes as long as its slowest rank
        return max(statistics.median(r[L][name]["t"]) for r in per_rank)

    if deepspeed:
        rows = tuple(Row(f"{v} vs DeepSpeed-Ulysses", f"{L} tokens", slowest(L, v), slowest(L, "deepspeed"))
                     for L in lengths for v in variants)
        report.sections.append(Section(f"step time on {world} ranks (slowest rank)", "deepspeed.sequence."
                                       "layer.DistributedAttention around the same local attention", rows,
                                       target=1.0, notes=(f"median of {rounds} rounds per rank (x4 at 1024 tokens, x2 at 2048), the variants "
                                                          "alternating within each round (the first one "
                                                          "rotating); a step takes its slowest rank's median",)))
        rows = tuple(Qty(f"{v} vs DeepSpeed-Ulysses", f"{L} tokens", max(r[L][v]["peak"] for r in per_rank),
                         max(r[L]["deepspeed"]["peak"] for r in per_rank), unit="B")
                     for L in lengths for v in variants)
        report.sections.append(Section("peak bytes per rank: the layer's inputs and allocations", "DeepSpeed-Ulysses",
                                       rows, notes=("the rank's q, k, v and output gradient, and everything the "
                                                    "layer's forward and backward allocate",)))
    rows = tuple(Row(f"{v} vs one rank, whole sequence", f"{L} tokens", slowest(L, v), r0[L]["none"]["t"][0]
                     if len(r0[L]["none"]["t"]) == 1 else statistics.median(r0[L]["none"]["t"]))
                 for L in lengths for v in variants)
    report.sections.append(Section("step time against no sequence parallelism", "the whole sequence on one rank",
                                   rows, notes=(f"ideal: 1/{world} of the compute, plus the exchange",)))
    rows = tuple(Qty(f"{v} vs one rank, whole sequence", f"{L} tokens", max(r[L][v]["peak"] for r in per_rank),
                     r0[L]["none"]["peak"], unit="B") for L in lengths for v in variants)
    report.sections.append(Section("peak bytes per rank against no sequence parallelism",
                                   "the whole sequence on one rank", rows,
                                   notes=(("inputs and allocations as above; flash attention keeps no scores, so "
                                           "besides the inputs one layer's allocations are its exchange buffers, "
                                           "output and gradients, several O(T/P) tensors per rank against the whole "
                                           f"sequence's few O(T) ones; a model's activations come to about 1/{world} "
                                           "(--model gpt)",)
                                          if attention == "flash" else
                                          (f"about 1/{world} expected for the linear parts; the causal "
                                           "scores are (T/P) x T per head in every variant",))))
    rows = tuple(Qty(f"{v} bytes sent per rank", f"{L} tokens", max(r[L][v]["sent"] for r in per_rank),
                     max(r[L]["deepspeed"]["sent"] for r in per_rank) if deepspeed else float("nan"), unit="B")
                 for L in lengths for v in variants)
    report.sections.append(Section("bytes sent per rank per layer (fwd)", "DeepSpeed-Ulysses (4 all-to-alls)", rows))
    if budget:
        longest = r0["longest"]
        rows = tuple(Qty(f"{v} vs one rank, whole sequence", f"{format_bytes(budget)} per rank", longest[v],
                         longest["none"], unit="tokens") for v in variants)
        report.sections.append(Section(
            "longest sequence that fits a memory budget per rank", "the whole sequence on one rank", rows,
            notes=("higher is better: ours/peer is how many times longer a sequence fits",
                   "peak per rank from a dry run (meta tensors, collectives answered locally) counted by the "
                   "memory tracker, as the peak rows above; DeepSpeed-Ulysses (not runnable on meta tensors) "
                   "allocates what our Ulysses does at every measured length")))
    report.finish()
    if plot:
        _plot(plot, per_rank, lengths, variants, deepspeed, world)
    return report


def _plot(path: str, per_rank: list, lengths: Sequence[int], variants: list, deepspeed: bool, world: int) -> None:
    """Step time and peak bytes per rank against sequence length, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(variants) + (["deepspeed"] if deepspeed else []) + ["none"]
    label = {"deepspeed": "DeepSpeed-Ulysses", "none": "one rank, whole sequence"}
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        ranks = per_rank[:1] if name == "none" else per_rank
        t = [max(statistics.median(r[L][name]["t"]) for r in ranks) for L in lengths]
        m = [max(r[L][name]["peak"] for r in ranks) / 2**20 for L in lengths]
        style = "--" if name in ("deepspeed", "none") else "-"
        ax_t.plot(lengths, t, style, marker="o", label=label.get(name, name))
        ax_m.plot(lengths, m, style, marker="o", label=label.get(name, name))
    for ax, what in ((ax_t, "step time (s, slowest rank)"), (ax_m, "peak bytes per rank (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"one causal attention layer, fwd + bwd, {world} gloo ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench seq", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short sequences, few rounds (a smoke run)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2; 4 adds the hybrid)")
    p.add_argument("--lengths", default="1024,4096", help="comma-separated sequence lengths")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds at 4096 tokens and up "
                   "(x2 at 2048, x4 at 1024 and shorter)")
    add_output_args(p)
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed (compared where installed)")
    p.add_argument("--budget", default="1GiB",
                   help="per-rank memory budget for the longest-sequence search, e.g. 512MiB, 2GiB (0: skip)")
    p.add_argument("--attention", choices=ATTENTION, default="flash",
                   help="the local attention (Ulysses, DeepSpeed's and the whole sequence run it; the ring's "
                   "blocks run flash_attention_with_lse): flash (fused, O(T) memory; default) or einsum "
                   "(explicit scores)")
    p.add_argument("--model", choices=("layer", "gpt"), default="layer",
                   help="one attention layer (default) or a small GPT's train step (d_model "
                   f"{GPT_D}, {GPT_LAYERS} layers, rotary)")
    p.add_argument("--plot", metavar="PNG", help="save step time and peak bytes against length as a picture")
    return p


def _parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    if unit not in units:
        raise SystemExit(f"fsharded bench seq: --budget {text!r}: give bytes, e.g. 512MiB or 2GiB")
    return int(float(num) * units[unit])


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
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("fsharded bench seq: --plot needs matplotlib (pip install 'fsharded[bench]')") from None
    if args.model == "gpt":
        report = run_gpt(args.ranks, lengths, 2 if args.quick else args.rounds, with_ds, args.attention)
        report.emit(args)
        return 0
    budget = 0 if args.quick else _parse_bytes(args.budget)
    report = run(args.ranks, lengths, 2 if args.quick else args.rounds, with_ds, budget, args.plot,
                 args.attention)
    report.emit(args)
    return 0
