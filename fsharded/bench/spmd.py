"""Overhead of the SPMD core against the plain PyTorch a user would otherwise write.

Three sections, each timed in alternating rounds of ours and the peer, medians reported::

    fsharded bench spmd                 # full run, a few minutes on 2 cores
    fsharded bench spmd --quick         # tiny sizes, a smoke run
    fsharded bench spmd --markdown      # a Markdown table for the README
    python -m fsharded.bench.spmd --only collectives

1. **shard_map on the virtual mesh vs plain torch.** An MLP ``gelu(x @ w1) @ w2`` with a
   mean-square loss, forward + backward. Ours: data-parallel ``shard_map`` over
   ``Mesh({"data": n})`` (batch sharded, weights replicated, loss ``psum``'d), either
   differentiated from outside or with ``torch.func.grad`` inside the body and ``psum``'d
   gradients (the ``train_step`` arrangement), and a 2x2 (data, tensor) Megatron MLP
   (``pvary`` then ``psum``). Peer: the same math on the full batch in eager torch. The
   FLOPs are equal, so the ratio is the cost of vmap levels and collectives on one process.
2. **Collectives on 2 gloo ranks vs torch.distributed.** Inside a ``shard_map`` body each
   rank times a loop of ``psum`` / ``all_gather`` / ``psum_scatter`` / ``all_to_all``;
   the peer loops ``all_reduce`` / ``all_gather_single`` / ``reduce_scatter_single`` /
   ``all_to_all_single`` on a tensor of the same size over the same process group, outputs
   preallocated; one more row pits ``psum`` against ``all_reduce(x.clone())``, since psum
   (like every functional collective) returns a new tensor. The slower rank's time counts.
   Sizes are the bytes of each rank's input. Ours take fsharded's same-host shared-memory
   transport when it is available (``FSHARDED_SHM=0``: gloo, as the peer).
3. **Dispatch cost without communication.** The same loops on a ``fake`` process group
   (collectives return at once), in a child process: what each call costs in Python and
   the dispatcher, apart from the network and the scheduler. Explains small-message ratios.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import P
from fsharded.bench import Report, Row, Section, add_output_args, alternate, calibrate

__all__ = [
    "main",
    "run",
    "virtual_section",
    "collective_section",
    "dispatch_section",
    "collective_rank",
    "dispatch_process",
]

# (B, D, H): batch, model width, hidden width.
MLP_SIZES = ((32, 128, 512), (256, 512, 2048), (1024, 512, 2048))
MLP_SIZES_QUICK = ((8, 16, 32),)
COLLECTIVE_BYTES = (4 << 10, 256 << 10, 4 << 20)
COLLECTIVE_BYTES_QUICK = (4 << 10,)
COLLECTIVE_OPS = (
    "psum", "psum_oop", "all_gather", "all_gather_oop", "psum_scatter", "psum_scatter_oop",
    "all_to_all", "all_to_all_oop",
)


def _ops(op: str, x: torch.Tensor, ws: int, group: object) -> tuple[str, Callable, Callable]:
    """For one case: its name, our collective on a rank's ``(n,)`` tensor, and the
    torch.distributed call of the same size (outputs preallocated, as a user would)."""
    import torch.distributed as dist

    n = x.numel()
    # The current names; ``*_into_tensor`` / ``*_tensor`` are deprecated aliases.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "psum":
        return (
            "psum vs all_reduce",
            lambda t: fs.psum(t, "x"),
            lambda: dist.all_reduce(x, group=group),
        )
    if op == "psum_oop":
        # psum is out of place (a new tensor, input kept), as every functional collective
        # is; this peer pays the same copy, to show what the semantics themselves cost.
        return (
            "psum vs all_reduce(x.clone())",
            lambda t: fs.psum(t, "x"),
            lambda: dist.all_reduce(x.clone(), group=group),
        )
    if op == "all_gather":
        out = torch.empty(n * ws)
        return (
            f"all_gather vs {gather.__name__}",
            lambda t: fs.all_gather(t, "x"),
            lambda: gather(out, x, group=group),
        )
    # The *_oop peers allocate their output on every call, as a functional collective must
    # (on CPU the allocator returns large blocks to the OS, so each call page-faults anew).
    if op == "all_gather_oop":
        return (
            f"all_gather vs {gather.__name__}(new out)",
            lambda t: fs.all_gather(t, "x"),
            lambda: gather(torch.empty(n * ws), x, group=group),
        )
    if op == "psum_scatter_oop":
        return (
            f"psum_scatter vs {scatter.__name__}(new out)",
            lambda t: fs.psum_scatter(t, "x"),
            lambda: scatter(torch.empty(n // ws), x, group=group),
        )
    if op == "all_to_all_oop":
        return (
            "all_to_all vs all_to_all_single(new out)",
            lambda t: fs.all_to_all(t, "x", split_dim=0, concat_dim=0),
            lambda: dist.all_to_all_single(torch.empty(n), x, group=group),
        )
    if op == "psum_scatter":
        out = torch.empty(n // ws)
        return (
            f"psum_scatter vs {scatter.__name__}",
            lambda t: fs.psum_scatter(t, "x"),
            lambda: scatter(out, x, group=group),
        )
    if op == "all_to_all":
        out = torch.empty(n)
        return (
            "all_to_all vs all_to_all_single",
            lambda t: fs.all_to_all(t, "x", split_dim=0, concat_dim=0),
            lambda: dist.all_to_all_single(out, x, group=group),
        )
    raise ValueError(f"unknown collective case {op!r}; known: {COLLECTIVE_OPS}")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


# -- 1. shard_map on the virtual mesh -------------------------------------------------------


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w1) @ w2  # (B, D)


def _plain_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return _mlp(x, w1, w2).pow(2).sum() / x.shape[0]


Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def _outer_grad(sm: Callable[..., torch.Tensor]) -> Step:
    """Differentiate a shard_map'ed loss from outside, as plain autograd would."""

    def step(x, w1, w2):
        w1.grad = w2.grad = None
        loss = sm(x, w1, w2)
        loss.backward()
        return loss.detach(), w1.grad, w2.grad

    return step


def _dp(n: int, batch: int) -> Step:
    """Data parallel over ``Mesh({"data": n})``, differentiated through shard_map."""

    def local(x, w1, w2):  # x: (B/n, D)
        return fs.psum(_mlp(x, w1, w2).pow(2).sum(), "data") / batch

    mesh = fs.Mesh({"data": n})
    return _outer_grad(
        fs.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P())
    )


def _dp_inner(n: int, batch: int) -> Step:
    """Data parallel with ``torch.func.grad_and_value`` inside the body, grads ``psum``'d
    (the weights marked varying over data first, as train_step does, so each shard's
    gradient is its own and one psum per gradient sums them)."""

    def local(x, w1, w2):
        w1, w2 = fs.pvary(w1, "data"), fs.pvary(w2, "data")

        def loss(w1, w2):
            return _mlp(x, w1, w2).pow(2).sum() / batch

        (g1, g2), value = torch.func.grad_and_value(loss, argnums=(0, 1))(w1, w2)
        return fs.psum(value, "data"), fs.psum(g1, "data"), fs.psum(g2, "data")

    mesh = fs.Mesh({"data": n})
    sm = fs.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P(), P(), P()))

    def step(x, w1, w2):
        with torch.no_grad():
            return sm(x, w1.detach(), w2.detach())

    return step


def _megatron(batch: int) -> Step:
    """2x2 (data, tensor): w1 column-sharded, w2 row-sharded; pvary in, psum out."""

    def local(x, w1, w2):  # x: (B/2, D), w1: (D, H/2), w2: (H/2, D)
        x = fs.pvary(x, "tensor")
        y = fs.psum(_mlp(x, w1, w2), "tensor")
        return fs.psum(y.pow(2).sum(), "data") / batch

    mesh = fs.Mesh({"data": 2, "tensor": 2})
    specs = (P("data", None), P(None, "tensor"), P("tensor", None))
    return _outer_grad(fs.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P()))


def _plain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w1.grad = w2.grad = None
    loss = _plain_loss(x, w1, w2)
    loss.backward()
    return loss.detach(), w1.grad, w2.grad


def _check(case: str, ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> None:
    # fp32, sums over at most a few thousand terms in a different order (per shard, then
    # psum): agreement to ~1e-4 relative to the largest entry is what rounding allows.
    for name, a, b in zip(("loss", "grad w1", "grad w2"), ours, ref):
        tol = 1e-4 * max(float(b.abs().max()), 1e-6)
        err = float((a - b).abs().max())
        if err > tol:
            raise RuntimeError(
                f"{case}: {name} differs from plain torch by {err:.3g} (> {tol:.3g})"
            )


def _time_against_plain(
    step: Step, args: tuple[torch.Tensor, ...], *, rounds: int, target_s: float
) -> tuple[list[float], list[float]]:
    iters = calibrate(lambda: step(*args), target_s)

    def block(fn: Step) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        return (time.perf_counter() - t0) / iters

    return alternate(lambda: block(step), lambda: block(_plain), rounds)


def virtual_section(
    sizes: Sequence[tuple[int, int, int]], *, rounds: int, target_s: float, seed: int = 0
) -> Section:
    rows = []
    for B, D, H in sizes:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, D, generator=g)
        w1 = (torch.randn(D, H, generator=g) / D**0.5).requires_grad_()
        w2 = (torch.randn(H, D, generator=g) / H**0.5).requires_grad_()
        cases: list[tuple[str, Step]] = [
            ("dp=2 fwd+bwd", _dp(2, B)),
            ("dp=4 fwd+bwd", _dp(4, B)),
            ("dp=2 grad in body", _dp_inner(2, B)),
            ("tp 2x2 Megatron fwd+bwd", _megatron(B)),
        ]
        ref = [t.clone() for t in _plain(x, w1, w2)]
        for case, step in cases:
            _check(case, step(x, w1, w2), ref)  # also the first (warm-up) call
            ours, peer = _time_against_plain(step, (x, w1, w2), rounds=rounds, target_s=target_s)
            row = Row.from_samples(case, f"{B}x{D}x{H}", ours, peer)
            _log(f"  {row.case:26s} {row.size:14s} ratio {row.ratio:.2f}")
            rows.append(row)
    return Section(
        title="shard_map on the virtual mesh vs plain torch, MLP forward+backward (size: BxDxH)",
        peer="the same math on the full batch in eager torch (loss.backward())",
        rows=tuple(rows),
        notes=(
            f"{rounds} rounds, {torch.get_num_threads()} torch thread(s); every case is "
            f"checked against the peer's loss and gradients before timing",
        ),
    )


# -- 2. collectives on gloo ranks, 3. the same on a fake process group ----------------------


def _collective_pair(
    op: str, nbytes: int, iters: int, mesh: fs.Mesh, group: object
) -> tuple[str, Callable[[], float], Callable[[], float]]:
    """The case's name and two timed blocks for it: ours inside a shard_map body, and
    the torch.distributed call it corresponds to. Each block returns seconds per call."""
    import torch.distributed as dist

    x = torch.zeros(nbytes // 4)  # zeros: the in-place peer all_reduce keeps it finite
    name, ours_op, peer_op = _ops(op, x, mesh.shape["x"], group)
    times: list[float] = []

    def body(t: torch.Tensor) -> torch.Tensor:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            ours_op(t)
        times.append((time.perf_counter() - t0) / iters)
        return t.new_zeros(())

    sm = fs.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())

    def ours() -> float:
        sm(x)
        return times.pop()

    def peer() -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            peer_op()
        return (time.perf_counter() - t0) / iters

    return name, ours, peer


# (op, bytes) -> (case name, ours per round, peer per round)
Samples = dict[tuple[str, int], tuple[str, list[float], list[float]]]


def _time_cases(cases: Sequence[tuple[str, int, int]], rounds: int) -> Samples:
    import torch.distributed as dist

    mesh = fs.Mesh({"x": dist.get_world_size()})
    group = fs.distributed.axis_group(mesh, ("x",)).group
    results = {}
    for op, nbytes, iters in cases:
        name, ours, peer = _collective_pair(op, nbytes, iters, mesh, group)
        ours(), peer()  # warm-up: first-call allocations and connections
        results[(op, nbytes)] = (name, *alternate(ours, peer, rounds))
    return results


def collective_rank(cases: Sequence[tuple[str, int, int]], rounds: int) -> tuple[Samples, bool]:
    """Runs on each gloo rank (via ``fsharded.testing.run_on_ranks``): for every
    ``(op, bytes, iters)`` the per-round seconds per call of ours and of the peer, and
    whether ours went over the same-host shared-memory transport."""
    from fsharded.comm import _shm

    samples = _time_cases(cases, rounds)
    return samples, _shm.in_use()


def dispatch_process(cases: Sequence[tuple[str, int, int]], rounds: int) -> Samples:
    """Runs in a child process: rank 0 of 2 on torch's ``fake`` process group, where every
    collective returns at once, so only the cost of issuing the call is timed."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        return _time_cases(cases, rounds)
    finally:
        dist.destroy_process_group()


def _cases(
    sizes: Sequence[int], iters: int | None, *, block_bytes: int, lo: int, hi: int
) -> list[tuple[str, int, int]]:
    # Enough calls per block that the timer and the barrier are noise, fewer for big sizes.
    return [
        (op, nbytes, iters or max(lo, min(hi, block_bytes // nbytes)))
        for op in COLLECTIVE_OPS
        for nbytes in sizes
    ]


def _rows(
    cases: Sequence[tuple[str, int, int]], rounds: int, per_rank: Sequence[Samples]
) -> tuple[Row, ...]:
    rows = []
    for op, nbytes, _ in cases:
        # A collective ends together on every rank; the slower rank's block is its time.
        name = per_rank[0][(op, nbytes)][0]
        ours = [max(r[(op, nbytes)][1][i] for r in per_rank) for i in range(rounds)]
        peer = [max(r[(op, nbytes)][2][i] for r in per_rank) for i in range(rounds)]
        rows.append(Row.from_samples(name, _size(nbytes), ours, peer))
    return tuple(rows)


def collective_section(
    sizes: Sequence[int], *, rounds: int, iters: int | None, world_size: int = 2
) -> Section:
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    cases = _cases(sizes, iters, block_bytes=16 << 20, lo=10, hi=200)
    # By module name, so the spawned ranks can import it however this process was started.
    fn = importlib.import_module("fsharded.bench.spmd").collective_rank
    per_rank = run_on_ranks(fn, world_size, cases, rounds)
    rows = _rows(cases, rounds, [samples for samples, _ in per_rank])
    transport = ("ours over fsharded's same-host shared-memory transport (csrc/shm_comm.cpp; "
                 "FSHARDED_SHM=0 sends them through gloo like the peer)"
                 if all(shm for _, shm in per_rank) else "ours through gloo, like the peer")
    return Section(
        title=f"fsharded collectives vs torch.distributed, gloo, {world_size} ranks "
        f"(size: bytes of each rank's fp32 input)",
        peer="the torch.distributed call of the same size on the same process group",
        rows=rows,
        target=1.1,
        notes=(
            f"ours is called in a loop inside a shard_map body and timed there; {rounds} "
            f"rounds, 1 thread per rank; the slower rank's time counts",
            transport,
        ),
    )


def dispatch_section(sizes: Sequence[int], *, rounds: int, iters: int | None) -> Section:
    cases = _cases(sizes, iters, block_bytes=64 << 20, lo=20, hi=2000)
    fn = importlib.import_module("fsharded.bench.spmd").dispatch_process
    # A fresh process: a process group (and fsharded's memoised axis groups) must not
    # outlive this section in the caller.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        samples = ex.submit(fn, cases, rounds).result()
    return Section(
        title="cost of issuing one collective, without communication (fake process group)",
        peer="the torch.distributed call on the same fake group",
        rows=_rows(cases, rounds, [samples]),
        notes=(
            "the fake group returns at once: what remains is the per-call cost of issuing "
            "the collective (Python, dispatcher, and any copy or allocation of the output), "
            "which the gloo section pays on top of the communication",
        ),
    )


# -- entry point ------------------------------------------------------------------------------

SECTIONS = ("virtual", "collectives", "dispatch")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "fsharded bench spmd",
        description="shard_map and collective overhead vs plain torch / torch.distributed, "
        "timed in alternating rounds in one run (medians, ratio = ours/peer).",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (smoke run)")
    add_output_args(p)
    p.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    p.add_argument(
        "--rounds",
        type=int,
        help="alternating rounds per case (default 7, 11 for collectives; 3 with --quick)",
    )
    # One thread by default: on 2 shared cores, with 2 threads an OpenMP barrier waits for
    # a descheduled thread whenever another process runs, and a 0.2 ms call took 90 ms.
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the virtual mesh section (default 1)",
    )
    p.add_argument("--iters", type=int, help="collective calls per timed block (default: by size)")
    return p


def run(args: argparse.Namespace) -> Report:
    torch.set_num_threads(args.threads)
    only = set(args.only or SECTIONS)
    quick = args.quick
    rounds = args.rounds or (3 if quick else 7)
    report = Report("spmd", params={"torch": torch.__version__})
    if "virtual" in only:
        _log("shard_map on the virtual mesh vs plain torch ...")
        sizes = MLP_SIZES_QUICK if quick else MLP_SIZES
        report.sections.append(
            virtual_section(sizes, rounds=rounds, target_s=0.005 if quick else 0.1)
        )
    coll_sizes = COLLECTIVE_BYTES_QUICK if quick else COLLECTIVE_BYTES
    coll_rounds = args.rounds or (3 if quick else 11)
    if "collectives" in only:
        _log("collectives on 2 gloo ranks vs torch.distributed ...")
        report.sections.append(
            collective_section(
                coll_sizes, rounds=coll_rounds, iters=args.iters or (5 if quick else None)
            )
        )
    if "dispatch" in only:
        _log("collective dispatch cost on a fake process group ...")
        report.sections.append(
            dispatch_section(
                sorted({coll_sizes[0], coll_sizes[-1]}),
                rounds=coll_rounds,
                iters=args.iters or (20 if quick else None),
            )
        )
    report.finish()
    return report


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """``fsharded bench spmd [--quick] [--markdown] [--only SECTION] ...``; returns 0."""
    args = build_parser(prog).parse_args(argv)
    report = run(args)
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
