"""ZenFlow's overlapped update (``zero(..., zenflow=ZenFlow(...))``): runs shared by the
virtual-mesh tests and the gloo ranks, and a plain-torch reference of its rule."""

from __future__ import annotations

import optree
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.kernels.fused_optim import fused_adamw_reference_
from fsharded.models import gpt
from fsharded.parallel.offload import ZenFlow

B1, B2, EPS = 0.9, 0.999, 1e-8


def make_step(mesh: dict, stage: int, zenflow: ZenFlow | None, *, donate: bool = True, clip=None,
              offload: str | None = "cpu", lr: float = T.LR, nvme_path: str | None = None):
    params = gpt.init(T.CONFIG, 0)
    kw = dict(offload_optimizer=offload, bucket_elems=4096, nvme_path=nvme_path) if offload else {}
    plan = fs.parallel.zero(stage, min_size=16, zenflow=zenflow, **kw)(P(), params)
    step = fs.train_step(gpt.loss, fs.optim.adamw(lr, weight_decay=T.WD), mesh=fs.Mesh(mesh), param_specs=plan,
                         clip=clip, donate=donate, blocks="blocks")
    return step, params


def run(mesh: dict, stage: int, zenflow: ZenFlow | None, steps: int, *, donate: bool = True, clip=None,
        offload: str | None = "cpu", batches: list | None = None, lr: float = T.LR,
        nvme_path: str | None = None) -> dict:
    step, params = make_step(mesh, stage, zenflow, donate=donate, clip=clip, offload=offload, lr=lr,
                             nvme_path=nvme_path)
    state = step.init(params)
    losses = []
    for b in batches if batches is not None else T.batches(steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.settle(state)
    return {"losses": losses, "params": [x.clone() for x in optree.tree_leaves(step.params(state))]}


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(1, -1)


def _adamw(p: list, g: list, m: list, v: list, step: int, scale: float = 1.0) -> None:
    fused_adamw_reference_(p, g, m, v, lr=T.LR, beta1=B1, beta2=B2, eps=EPS, weight_decay=T.WD, step=step,
                           check_finite=False, inv_scale=scale)


def reference(zf: ZenFlow, steps: int, clip: float | None = None) -> dict:
    """ZenFlow's rule on one device in plain torch, with no thread and no tier: the hot
    rows (the top ``topk_ratio`` of each leaf's rows by gradient L1 norm, reselected at the
    first step of an interval once ``select_interval`` steps have passed) take AdamW at
    once with moments of their own; the rest take AdamW on the mean gradient of each
    ``update_interval`` steps, applied when the step after the interval updates. ``clip``:
    each step's gradients scaled by its clipping factor (``optim.clip_factor`` of their
    global norm), the cold ones as they are summed."""
    params = optree.tree_leaves(gpt.init(T.CONFIG, 0))
    treedef = optree.tree_structure(gpt.init(T.CONFIG, 0))
    p = [x.clone() for x in params]
    m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
    hot = pend = summed = None
    count = since = 0
    losses = []

    def land() -> None:
        for x, new, (idx, _, _) in zip(p, pend, hot):
            keep = _rows(x)[idx].clone()
            _rows(x).copy_(_rows(new))
            _rows(x)[idx] = keep

    for t, batch in enumerate(T.batches(steps)):
        g, loss = torch.func.grad_and_value(lambda q, b=batch: gpt.loss(optree.tree_unflatten(treedef, q), b))(p)
        losses.append(float(loss))
        g = [x.contiguous() for x in g]
        f = float(fs.optim.clip_factor(fs.optim.global_norm(g), clip)) if clip is not None else 1.0
        if t < zf.warmup_steps:
            _adamw(p, [x.clone() for x in g], m, v, t + 1, f)
            continue
        if pend is not None:
            land()
            pend = None
        if (hot is None or since >= zf.select_interval) and not count:
            for x_m, x_v, (idx, hm, hv) in zip(m, v, hot or []):
                _rows(x_m)[idx], _rows(x_v)[idx] = hm, hv
            hot = []
            for gx, x_m, x_v in zip(g, m, v):
                rows = _rows(gx)
                k = zf.rows(rows.shape[0])
                idx = rows.abs().sum(-1).topk(k).indices.sort().values
                hot.append((idx, _rows(x_m)[idx].clone(), _rows(x_v)[idx].clone()))
            since = 0
        for x, gx, (idx, hm, hv) in zip(p, g, hot):
            ph = _rows(x)[idx].clone()
            _adamw([ph], [_rows(gx)[idx].clone()], [hm], [hv], t + 1, f)
            _rows(x)[idx] = ph
        scaled = [x * f for x in g] if f != 1.0 else g
        summed = [x.clone() for x in scaled] if summed is None else [a + x for a, x in zip(summed, scaled)]
        count += 1
        if count == zf.update_interval:
            pend = [x.clone() for x in p]
            _adamw(pend, [a / count if count > 1 else a for a in summed], m, v, t + 1)
            summed, count = None, 0
        since += 1
    # settle: what is in flight lands, the summed rest applied as an interval of its own
    if pend is not None:
        land()
    if count:
        pend = [x.clone() for x in p]
        _adamw(pend, [a / count for a in summed], m, v, steps)
        land()
    return {"losses": losses, "params": p}


def gloo_zenflow(world: int, nvme_path: str) -> dict:
    """On each rank: ZenFlow at ZeRO 1, 2 and 3, stale and with every row hot, against the
    exact offloaded update; and over the NVMe tier at ZeRO-2."""
    zf = ZenFlow(0.25, select_interval=3, update_interval=2)
    return {
        "stale": {stage: run({"data": world}, stage, zf, 8, clip=T.CLIP) for stage in (1, 2, 3)},
        "all_hot": run({"data": world}, 2, ZenFlow(1.0), 5),
        "exact": run({"data": world}, 2, None, 5),
        "nvme": run({"data": world}, 2, zf, 8, clip=T.CLIP, offload="nvme", nvme_path=nvme_path),
    }
