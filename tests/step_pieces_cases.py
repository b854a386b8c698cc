"""The gradient side of train_step piece by piece (the spec-derived reduction, each
gradient strategy), shared by the virtual-mesh tests and the gloo ranks. Everything in
float64: the sharded results equal the references up to summation order."""

from __future__ import annotations

import functools

import optree
import torch

import fsharded as fs
from fsharded import P
from fsharded.parallel.zero import Placement
from fsharded.precision import Policy
from fsharded.spmd.collectives import mark_varying, pmean
from fsharded.step._checks import _check_loss
from fsharded.step._differentiate import Inputs, LocalLoss, differentiator
from fsharded.step._grad_accumulate import Accumulated
from fsharded.step._grad_blocks import BlockLoss
from fsharded.step._grad_plain import Plain
from fsharded.step._layout import Layout
from fsharded.step._reduce import Reduction
from fsharded.step._scaling import NoScaling

F64 = Policy(param_dtype=torch.float64, compute_dtype=torch.float64, reduce_dtype=torch.float64,
             master_dtype=torch.float64)
CAP = 12  # elements per bucket: several buckets, and leaves larger than one, in every test
Z = P("data")

# -- the reduction alone ---------------------------------------------------------------------

# A mixed tree: one leaf per movement, beside a replicated and a frozen one. The stage field
# says 0 on purpose: the step must read the specs, not the stage.
R_SHAPES = {"z3": (4, 3), "z2": (6, 2), "z1": (8,), "rep": (3,), "frozen": (4,)}
R_SPECS = {  # use, params, grads, master
    "z3": (P(), Z, Z, Z),  # gathered inside the loss: its gradient comes back reduce-scattered
    "z2": (P(), P(), Z, Z),  # reduce-scattered
    "z1": (P(), P(), P(), Z),  # all-reduced, this rank's slice kept
    "rep": (P(), P(), P(), P()),  # all-reduced
    "frozen": (P(), P(), P(), P()),
}


def reduction_placement() -> Placement:
    trees = [{k: v[i] for k, v in R_SPECS.items()} for i in range(4)]
    mask = tuple(k != "frozen" for k in sorted(R_SPECS))  # flatten order: sorted keys
    return Placement(*trees, stage=0, axis="data", trainable=mask)


def reduction_case(seed: int = 0) -> dict:
    """Each shard's gradients, in their params layout, and what the reduction must give:
    their mean over the two shards, in the master layout (global values)."""
    g = torch.Generator().manual_seed(seed)
    per_shard = {k: torch.randn((2, *s), generator=g, dtype=torch.float64) for k, s in R_SHAPES.items()
                 if k != "frozen"}
    mean = {k: v.mean(0) for k, v in per_shard.items()}
    # z3: what the gather's transpose hands each shard is its block of the shards' sum.
    inputs = {k: (v.sum(0) if k == "z3" else v) for k, v in per_shard.items()}
    return {"inputs": inputs, "mean": mean}


def run_reduction(mesh: fs.Mesh, case: dict) -> dict:
    pl = reduction_placement()
    params = {k: torch.zeros(s, dtype=torch.float64) for k, s in R_SHAPES.items()}
    layout = Layout(pl, params, None, mesh)
    reduce = Reduction(layout, ("data",), CAP, torch.float64)
    names = [k for k in sorted(R_SHAPES) if k != "frozen"]
    assert layout.t_paths == names

    def body(inputs: dict) -> list:
        # A stacked input's local (1, ...) block is this shard's own gradient.
        leaves = [inputs[k] if k == "z3" else inputs[k][0] for k in names]
        return reduce(leaves)

    in_specs = ({k: Z for k in names},)
    out_specs = [R_SPECS[k][3] for k in names]
    sm = fs.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with torch.no_grad():
        out = sm(case["inputs"])
    return dict(zip(names, out))


# -- the strategies ----------------------------------------------------------------------------

D_IN, H, D_OUT, ROWS = 6, 8, 2, 8


def block_fn(p: dict, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["w"] + p["b"])  # (B, H)


def loss_fn(p: dict, batch: dict) -> torch.Tensor:
    """Per-shard MSE of a small MLP whose blocks run through ``run_block`` (plainly when no
    handler is installed); ``gain`` is frozen."""
    h = (batch["x"] @ p["inp"]) * p["gain"]  # (B, H)
    for blk in p["blocks"]:
        h = fs.parallel.run_block(block_fn, blk, h)
    return ((h @ p["out"] + p["bias"] - batch["y"]) ** 2).mean()


def model(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=g, dtype=torch.float64)
    params = {"inp": r(D_IN, H) * 0.5, "gain": 1 + 0.1 * r(H), "blocks": [
        {"w": r(H, H) * 0.3, "b": 0.1 * r(H)} for _ in range(2)], "out": r(H, D_OUT), "bias": r(D_OUT)}
    batch = {"x": r(ROWS, D_IN), "y": r(ROWS, D_OUT)}
    return params, batch


TRAINS = lambda path: path != "gain"  # noqa: E731


def reference(params: dict, batch: dict) -> tuple[dict, torch.Tensor]:
    """torch.func.grad of the whole model's loss on the whole batch (the mean over the
    shards' equal row counts is the mean over every row)."""
    grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
    return grads, loss


def mixed_placement(params: dict) -> Placement:
    """Every movement in one tree (by path), frozen ``gain`` sharded and gathered for use."""
    kinds = {"inp": "z3", "gain": "z3", "blocks.0.w": "z2", "blocks.0.b": "z1", "blocks.1.w": "rep",
             "blocks.1.b": "z3", "out": "z1", "bias": "rep"}
    paths, _, tdef = fs._tree.tree_flatten_with_paths(params)
    trees = [optree.tree_unflatten(tdef, [R_SPECS[kinds[p]][i] for p in paths]) for i in range(4)]
    return Placement(*trees, stage=0, axis="data", trainable=tuple(TRAINS(p) for p in paths))


def zero_placement(stage: int, params: dict, mesh: fs.Mesh) -> Placement:
    paths = fs._tree.tree_flatten_with_paths(params)[0]
    pl = fs.parallel.zero(stage, min_size=8)(P(), params).resolve(mesh)
    return pl.freeze([TRAINS(p) for p in paths])


def strategy(kind: str, layout: Layout, mesh: fs.Mesh, *, eager: bool, distributed: bool):
    common = dict(policy=F64, scaling=NoScaling(), cap=CAP,
                  check_loss=functools.partial(_check_loss, ("data",), mesh))
    if kind == "blocks":
        loss = BlockLoss(layout, loss_fn, distributed=distributed, **common)
    else:
        loss = LocalLoss(layout, loss_fn, **common)
    grad = differentiator(eager=eager, backward_ctx=loss.backward_ctx)
    inputs, reduction = Inputs(layout, CAP), Reduction(layout, ("data",), CAP, torch.float64)
    if kind == "accumulated":
        return Accumulated(inputs, loss, reduction, grad, k=2, dtype=torch.float64)
    return Plain(inputs, loss, reduction, grad, dtype=torch.float64,
                 reduce_in_backward=distributed and eager and reduction.in_backward)


# case -> (strategy, placement: "mixed" or a ZeRO stage). On real ranks "plain-zero2"
# reduce-scatters in backward; "accumulated" (ZeRO-1) slices after the reduction.
STRATEGIES = {"plain": ("plain", "mixed"), "plain-zero2": ("plain", 2), "accumulated": ("accumulated", 1),
              "blocks": ("blocks", 3)}


def run_strategy(case: str, mesh: fs.Mesh, *, eager: bool = False, distributed: bool = False) -> dict:
    """The strategy's reduced gradients (global values, by path) and mean loss."""
    params, batch = model()
    kind, placement = STRATEGIES[case]
    pl = mixed_placement(params) if placement == "mixed" else zero_placement(placement, params, mesh)
    layout = Layout(pl, params, "blocks" if kind == "blocks" else None, mesh)
    grads = strategy(kind, layout, mesh, eager=eager, distributed=distributed)

    def body(p: dict, b: dict) -> tuple:
        leaves, loss, _ = grads(p, b, None, ("data",), mark_varying)
        return leaves, pmean(loss, "data")

    sm = fs.shard_map(body, mesh=mesh, in_specs=(pl.master, Z), out_specs=(layout.t_master, P()))
    with torch.no_grad():
        leaves, loss = sm(params, batch)
    return {"grads": dict(zip(layout.t_paths, leaves)), "loss": loss,
            "in_backward": getattr(grads, "reduce_in_backward", False)}


def on_gloo(world: int) -> dict:
    """On real ranks (plain autograd: the reduction in backward, ZeRO-3's prefetch and
    overlapped reduce-scatters): the reduction alone and every strategy."""
    mesh = fs.Mesh({"data": world})
    out = {"reduction": run_reduction(mesh, reduction_case())}
    for case in STRATEGIES:
        out[case] = run_strategy(case, mesh, eager=True, distributed=True)
    return out


def train_mixed(mesh_axes: dict, mixed: bool, steps: int = 3) -> dict:
    """``train_step`` with the mixed placement (every movement in one tree, a frozen leaf;
    ``blocks.1.b`` gathered at its block's ``run_block``) or replicated specs: losses and
    final parameters."""
    mesh = fs.Mesh(mesh_axes)
    params, batch = model()
    specs = mixed_placement(params) if mixed else P()
    step = fs.train_step(loss_fn, fs.optim.adamw(1e-2), mesh=mesh, param_specs=specs, precision=F64,
                         trainable=lambda path, _: TRAINS(path), blocks="blocks")
    state = step.init(params)
    losses = []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": step.params(state)}


def in_backward_unused(world: int) -> dict:
    """The reduction run inside backward (real ranks) where one leaf of each bucket kind
    gets no gradient: its bucket's memory is not zeroed when allocated (here filled with
    nan on purpose), so only the zeroing of the columns no hook filled keeps it at zero.
    Each rank's gradients of the used leaves are rank-dependent; the result must be their
    mean over the ranks, in the master layout (global values)."""
    from fsharded.parallel import _buckets as B
    from fsharded.spmd import _env

    class Poisoned(B.InBackward):
        def _buffer(self, b):
            fresh = b.buf is None
            buf = super()._buffer(b)
            if fresh:
                buf.fill_(float("nan"))
            return buf

    mesh = fs.Mesh({"data": world})
    kinds = {"a": "z2", "b": "z2", "c": "rep", "d": "rep", "e": "z1"}
    shapes = {"a": (4, 3), "b": (2, 2), "c": (3,), "d": (5,), "e": (8,)}
    unused = ("b", "d")
    trees = [{k: R_SPECS[v][i] for k, v in kinds.items()} for i in range(4)]
    pl = Placement(*trees, stage=0, axis="data")
    params = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    layout = Layout(pl, params, None, mesh)
    reduce = Reduction(layout, ("data",), CAP, torch.float64)
    names = sorted(shapes)
    weights = {k: torch.arange(1.0, 1 + torch.Size(s).numel(), dtype=torch.float64).reshape(s)
               for k, s in shapes.items()}

    def body(p: dict) -> list:
        r = float(torch.distributed.get_rank()) + 1.0
        x0 = mark_varying([p[k] for k in names], "data")  # as the step marks them
        assert reduce.during_backward(x0) is not None
        reducer = Poisoned(reduce._layouts[tuple(tuple(x.shape) for x in x0)], torch.float64,
                           _env.current().vma)
        with torch.enable_grad():
            req = [x.detach().requires_grad_() for x in x0]
            reducer.watch(req)
            loss = sum(((r * weights[k] * x) ** 2).sum() / 2 for k, x in zip(names, req) if k not in unused)
            torch.autograd.grad(loss, req, allow_unused=True)
        return reduce.place(reducer.finish())

    ones = {k: torch.ones(s, dtype=torch.float64) for k, s in shapes.items()}
    sm = fs.shard_map(body, mesh=mesh, in_specs=(pl.params,), out_specs=[pl.master[k] for k in names])
    with torch.no_grad():
        out = sm(ones)
    # d/dx of (r w x)^2 / 2 at x = 1 is r^2 w^2; averaged over the ranks r = 1..world.
    mean_r2 = sum((r + 1.0) ** 2 for r in range(world)) / world
    expect = {k: torch.zeros(s, dtype=torch.float64) if k in unused else mean_r2 * weights[k] ** 2
              for k, s in shapes.items()}
    return {"got": dict(zip(names, out)), "expect": expect}
