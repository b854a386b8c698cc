"""Programs for the dry-run tests (``test_dry_run.py``), shared by the virtual mesh and the
gloo ranks: a small model whose forward reads tensor values on the host, as third-party
model code does, and the same model without the reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fsharded as fs

D_IN, D_HIDDEN, D_OUT, ROWS = 6, 16, 3, 8


class HostReads(torch.nn.Module):
    """Two linear layers. With ``host_reads`` the forward reads values on the host the way
    library code does (a finite check, a data-dependent branch, a scale read with
    ``.item()``, counts through ``.tolist()``); none of it changes the collectives or the
    result, so the model without them is the reference. Written to run on any values,
    zeros included (a dry run of meta arguments computes on zeros)."""

    def __init__(self, host_reads: bool = True) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, D_HIDDEN)
        self.fc2 = torch.nn.Linear(D_HIDDEN, D_OUT)
        self.host_reads = host_reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))  # (B, D_HIDDEN)
        if self.host_reads:
            if bool(torch.isnan(h).any()):
                raise FloatingPointError("HostReads: NaN activations")
            peak = h.abs().amax().item()
            if h.sum() > 0 and peak > 2.0:  # tanh keeps |h| < 1: never taken
                h = h / peak
            active = (h > 0).sum(0).tolist()
            if len(active) != D_HIDDEN:
                raise AssertionError(active)
        return self.fc2(h)


def model(host_reads: bool) -> HostReads:
    torch.manual_seed(0)
    return HostReads(host_reads)


def params_of(m: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def loss_of(m: torch.nn.Module):
    """The model as a pure loss over a flat ``{name: tensor}`` dict."""

    def loss(p: dict, batch: dict) -> torch.Tensor:
        out = torch.func.functional_call(m, p, (batch["x"],))
        return F.mse_loss(out, batch["y"])

    return loss


def batch() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(ROWS, D_IN, generator=g),
            "y": torch.randn(ROWS, D_OUT, generator=g)}


def manifest(m) -> list[tuple]:
    return [(e.phase, e.op, e.axis, e.dtype, e.shape, e.bytes_sent) for e in m]


def steps(host_reads: bool, *, mesh: fs.Mesh, check_schedule: bool = True, donate: bool = False,
          n: int = 2) -> dict:
    """``n`` data-parallel steps of the model; the losses, the final parameters and the
    manifest of one more step. (On the virtual mesh the host-reading model cannot take a
    step, vmap cannot read batched values, but its manifest can be listed: ``n=0``.)"""
    m = model(host_reads)
    step = fs.train_step(loss_of(m), fs.optim.adamw(1e-2), mesh=mesh, check_schedule=check_schedule,
                         donate=donate)
    state = step.init(params_of(m))
    b = batch()
    losses = []
    for _ in range(n):
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    man = manifest(step.collectives(state, b))
    # This process's own: on real ranks the schedule check's record (or, unchecked, a dry
    # run of its own), on the virtual mesh collectives().
    own = manifest(step.own_collectives(state, b))
    return {"losses": losses, "params": step.params(state), "manifest": man, "own": own}


def on_ranks(world: int) -> dict:
    """On each gloo rank: the host-reading model with the cross-rank schedule check (its
    dry run has to compute: neither meta nor fake tensors can read values), the same with
    the check off and with donated state (the dry run must leave the state alone), and the
    model without host reads."""
    mesh = fs.Mesh({"data": world})
    return {"checked": steps(True, mesh=mesh),
            "unchecked": steps(True, mesh=mesh, check_schedule=False),
            "donated": steps(True, mesh=mesh, donate=True),
            "plain": steps(False, mesh=mesh)}


def check_weights(w: torch.Tensor) -> None:
    """A check on values: only real values run it (and a dry run of meta arguments
    computes on zeros, which it refuses)."""
    if not bool((w != 0).any()):
        raise ValueError("weights are all zero: initialise them first")


def needs_values(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    check_weights(w)
    return fs.psum((x @ w).sum(), "data")


def needs_values_loss(p: dict, batch: dict) -> torch.Tensor:
    check_weights(p["w"])
    return (batch["x"] @ p["w"]).sum()
