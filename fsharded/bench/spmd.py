"""Overhead of the SPMD core against the plain PyTorch a user would otherwise write.

Two sections, each timed in alternating rounds of ours and the peer, medians reported::

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
   the peer loops ``all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
   ``all_to_all_single`` on a tensor of the same size over the same process group. The
   slower rank's time counts. Sizes are the bytes of each rank's input.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import P
from fsharded.bench import Report, Row, Section, alternate, calibrate

__all__ = ["main", "run", "virtual_section", "collective_section", "collective_rank"]

# (B, D, H): batch, model width, hidden width.
MLP_SIZES = ((32, 128, 512), (256, 512, 2048), (1024, 512, 2048))
MLP_SIZES_QUICK = ((8, 16, 32),)
COLLECTIVE_BYTES = (4 << 10, 256 << 10, 4 << 20)
COLLECTIVE_BYTES_QUICK = (4 << 10,)
COLLECTIVE_OPS = ("psum", "all_gather", "psum_scatter", "all_to_all")
_PEER_NAME = {
    "psum": "all_reduce",
    "all_gather": "all_gather_into_tensor",
    "psum_scatter": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
}


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
    return _outer_grad(fs.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P()))


def _dp_inner(n: int, batch: int) -> Step:
    """Data parallel with ``torch.func.grad_and_value`` inside the body, grads ``psum``'d."""

    def local(x, w1, w2):
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
            raise RuntimeError(f"{case}: {name} differs from plain torch by {err:.3g} (> {tol:.3g})")


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
            _check(case, step(x, w1, w2), ref)
            iters = calibrate(lambda step=step: step(x, w1, w2), target_s)

            def block(fn: Step, iters: int = iters) -> float:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(x, w1, w2)
                return (time.perf_counter() - t0) / iters

            ours, peer = alternate(lambda step=step: block(step), lambda: block(_plain), rounds)
            row = Row.from_samples(case, f"{B}x{D}x{H}", ours, peer)
            _log(f"  {row.case:26s} {row.size:14s} ratio {row.ratio:.2f}")
            rows.append(row)
    return Section(
        title="shard_map on the virtual mesh vs plain torch, MLP forward+backward (size: BxDxH)",
        peer="the same math on the full batch in eager torch (loss.backward())",
        rows=tuple(rows),
        notes=(
            f"threads: {torch.get_num_threads()}; every case is checked against the peer's "
            f"loss and gradients before timing",
        ),
    )


# -- 2. collectives on gloo ranks ------------------------------------------------------------


def _collective_pair(
    op: str, nbytes: int, iters: int, mesh: fs.Mesh, group: object
) -> tuple[Callable[[], float], Callable[[], float]]:
    """Two timed blocks for one op and size: ours inside a shard_map body, and the
    torch.distributed call it corresponds to. Each returns seconds per call."""
    import torch.distributed as dist

    n = nbytes // 4
    ws = mesh.shape["x"]
    x = torch.zeros(n)  # zeros: the in-place peer all_reduce keeps it finite
    ours_op: Callable[[torch.Tensor], torch.Tensor]
    peer_op: Callable[[], object]
    if op == "psum":
        ours_op = lambda t: fs.psum(t, "x")  # noqa: E731
        peer_op = lambda: dist.all_reduce(x, group=group)  # noqa: E731
    elif op == "all_gather":
        out = torch.empty(n * ws)
        ours_op = lambda t: fs.all_gather(t, "x")  # noqa: E731
        peer_op = lambda: dist.all_gather_into_tensor(out, x, group=group)  # noqa: E731
    elif op == "psum_scatter":
        out = torch.empty(n // ws)
        ours_op = lambda t: fs.psum_scatter(t, "x")  # noqa: E731
        peer_op = lambda: dist.reduce_scatter_tensor(out, x, group=group)  # noqa: E731
    elif op == "all_to_all":
        out = torch.empty(n)
        ours_op = lambda t: fs.all_to_all(t, "x", split_dim=0, concat_dim=0)  # noqa: E731
        peer_op = lambda: dist.all_to_all_single(out, x, group=group)  # noqa: E731
    else:
        raise ValueError(f"unknown collective {op!r}; known: {COLLECTIVE_OPS}")

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

    return ours, peer


def collective_rank(
    cases: Sequence[tuple[str, int, int]], rounds: int
) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """Runs on each gloo rank (via ``fsharded.testing.run_on_ranks``): for every
    ``(op, bytes, iters)`` the per-round seconds per call of ours and of the peer."""
    import torch.distributed as dist

    mesh = fs.Mesh({"x": dist.get_world_size()})
    group = fs.distributed.axis_group(mesh, ("x",)).group
    results = {}
    for op, nbytes, iters in cases:
        ours, peer = _collective_pair(op, nbytes, iters, mesh, group)
        ours(), peer()  # warm-up: first-call allocations and gloo connections
        results[(op, nbytes)] = alternate(ours, peer, rounds)
    return results


def collective_section(
    sizes: Sequence[int], *, rounds: int, iters: int | None, world_size: int = 2
) -> Section:
    from fsharded.testing import run_on_ranks

    # Enough calls per block that the timer and the barrier are noise, fewer for big sizes.
    cases = [
        (op, nbytes, iters or max(10, min(200, (16 << 20) // nbytes)))
        for op in COLLECTIVE_OPS
        for nbytes in sizes
    ]
    # By module name, so the spawned ranks can import it however this process was started.
    fn = importlib.import_module("fsharded.bench.spmd").collective_rank
    per_rank = run_on_ranks(fn, world_size, cases, rounds)
    rows = []
    for op, nbytes, _ in cases:
        # A collective ends together on every rank; the slower rank's block is its time.
        ours = [max(r[(op, nbytes)][0][i] for r in per_rank) for i in range(rounds)]
        peer = [max(r[(op, nbytes)][1][i] for r in per_rank) for i in range(rounds)]
        rows.append(Row.from_samples(f"{op} vs {_PEER_NAME[op]}", _size(nbytes), ours, peer))
    return Section(
        title=f"fsharded collectives vs torch.distributed, gloo, {world_size} ranks (size: bytes per rank's input, fp32)",
        peer="the torch.distributed call of the same size on the same process group",
        rows=tuple(rows),
        target=1.1,
        notes=(
            "ours is called inside a shard_map body and timed there; 1 thread per rank; "
            "the slower rank's time counts",
        ),
    )


# -- entry point ------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "fsharded bench spmd",
        description="shard_map and collective overhead vs plain torch / torch.distributed.",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (smoke run)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown report")
    p.add_argument(
        "--only", choices=("virtual", "collectives"), help="run one section only"
    )
    p.add_argument("--rounds", type=int, help="alternating rounds per case (default 7, quick 3)")
    p.add_argument("--threads", type=int, help="torch threads for the virtual-mesh section")
    p.add_argument("--iters", type=int, help="collective calls per timed block (default: by size)")
    return p


def run(args: argparse.Namespace) -> Report:
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 7)
    report = Report("spmd", params={"rounds": rounds, "torch": torch.__version__})
    if args.only in (None, "virtual"):
        _log("shard_map on the virtual mesh vs plain torch ...")
        report.sections.append(
            virtual_section(
                MLP_SIZES_QUICK if args.quick else MLP_SIZES,
                rounds=rounds,
                target_s=0.005 if args.quick else 0.1,
            )
        )
    if args.only in (None, "collectives"):
        _log("collectives on 2 gloo ranks vs torch.distributed ...")
        report.sections.append(
            collective_section(
                COLLECTIVE_BYTES_QUICK if args.quick else COLLECTIVE_BYTES,
                rounds=rounds if args.rounds or args.quick else 11,
                iters=args.iters or (5 if args.quick else None),
            )
        )
    report.finish()
    return report


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    report = run(args)
    report.print(markdown=args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
