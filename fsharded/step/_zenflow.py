"""ZenFlow's overlapped update (``parallel.offload.ZenFlow``): the important rows of each
parameter shard updated on the device at once, the rest by the host tier in a thread that
runs beside the next step, its result landing when that step updates.

One step's update, on each shard viewed as ``(devices, rows, row elements)`` beneath the
virtual mesh's levels (one device on a real rank):

1. land the host update started by the last step (its cold rows into the parameters);
2. at a selection (the first step, then every ``select_interval`` steps) write the hot
   rows' device moments back to the tier and pick the new hot rows (the largest gradient
   L1 norm), their moments fetched to the device (an NVMe tier's moments read and written
   whole through its checksummed I/O);
3. update the hot rows on the device (the fused kernel on gathered rows);
4. add the gradients to the interval's host sums; at the interval's last step, start the
   tier's update with their mean, on host copies of the parameters, in a thread
   (``offload.stream_update``: every row; the hot rows' results are dropped).

The step's counters and learning rate are taken once per step, so both halves update with
the same ones. The thread touches host buffers and the tier's moments only; nothing in
the step reads them until it lands.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import optree
import torch

from fsharded import optim
from fsharded.parallel import offload as _offload
from fsharded.spmd import _manifest
from fsharded.spmd._virtual import beneath
from fsharded.step._update import OffloadedUpdate, _Run, _skip

__all__ = ["ZenFlowUpdate"]


def _rows(t: torch.Tensor, levels: int) -> torch.Tensor:
    """``t`` (a shard beneath ``levels`` leading level dims) as ``(devices, rows, row
    elements)``: rows along its first dim; a leaf of fewer than 2 dims is one row."""
    devices = math.prod(t.shape[:levels])
    local = t.shape[levels:]
    rows = local[0] if len(local) >= 2 else 1
    return t.reshape(devices, rows, math.prod(local) // max(rows, 1) if rows else 0)


def _key(p_base: list[torch.Tensor]) -> tuple:
    return tuple(p.untyped_storage().data_ptr() for p in p_base)


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of ``t`` (contiguous; page-locked where ``t`` is on a GPU)."""
    if t.device.type == "cpu":
        return t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    return out.copy_(t, non_blocking=True)


class _Pending:
    """The tier's update of one interval running in a thread: ``params`` (host copies of the
    parameters, updated in place) once ``wait`` returns. ``ready``: where the copies come
    from a GPU, the event after them, which the thread waits for before it reads them."""

    def __init__(self, held: _Held, params: list[torch.Tensor], grads: list[torch.Tensor], offload: Any,
                 ready: Any = None) -> None:
        self.params, self.error = params, None
        step, moments, decay = held.cold, held.moments, held.decay

        def work() -> None:
            try:
                if ready is not None:
                    ready.synchronize()
                _offload.stream_update(step, [p.view(-1) for p in params], [g.view(-1) for g in grads],
                                       moments, decay, offload)
            except BaseException as e:  # noqa: BLE001 - raised where the step waits for it
                self.error = e

        self.thread = threading.Thread(target=work, name="fsharded-zenflow", daemon=True)
        self.thread.start()

    def wait(self) -> list[torch.Tensor]:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"zenflow: the host update failed: {self.error}") from self.error
        return self.params


class _Held:
    """What a step keeps of its update for the next one (not its gradients): the state's
    parameters and moments as ``_rows`` views, the moments flat for the tier's update, the
    decay flags, and the ``FusedStep`` the cold rows are updated with (the clipping factor
    already applied to their gradients as they were summed)."""

    def __init__(self, run: _Run, p3: list[torch.Tensor], m3: list[list[torch.Tensor]], optimizer: Any) -> None:
        self.p3, self.m3, self.decay = p3, m3, run.decay
        self.moments = [[m.view(-1) for m in ms] for ms in run.moments]
        self.cold = optim.FusedStep(optimizer, run.step.state, inv_scale=1.0)


class ZenFlowUpdate(OffloadedUpdate):
    """``OffloadedUpdate`` with ZenFlow's split (see the module doc and ``ZenFlow``). It
    holds, between steps, the update in flight, the cold gradients summed so far and the
    hot rows' device moments of the state it returned last; ``settle`` puts them into
    that state. Another state passed while it holds them is an error, not a silent drop."""

    def __init__(self, optimizer: Any, eager: bool, offload: Any, donate: bool) -> None:
        super().__init__(optimizer, eager, offload, donate)
        self.zf = offload.zenflow
        self.pending: _Pending | None = None
        self.hot: list | None = None  # per leaf: (row index (devices, k), [hot moment (devices, k, elems)])
        self.summed: list[torch.Tensor] | None = None  # host sums of this interval's clipped gradients
        self.count = 0  # steps summed in ``summed``
        self.since = 0  # steps since the selection
        self.held: tuple | None = None  # the state it holds things for: its parameters' storages
        self.last: _Held | None = None  # what it keeps of that state's last update

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry() or _skip(ok):  # a skipped step: what is held stays so
            return params, opt_state
        self._check(_key([beneath(t)[0] for t in optree.tree_leaves(params)]))
        if not self.donate:
            params = optree.tree_map(lambda t: t.clone(), params)
        run = self._inputs(grads, factor, opt_state, params)
        if not all(p.is_contiguous() for p in run.p_base):
            raise NotImplementedError("zenflow: a parameter laid out strided (on the virtual mesh, a leaf sharded "
                                      "on an inner dim) is not supported; shard it on its first dim, or run on "
                                      "real ranks")
        p3 = [_rows(p, lv) for p, lv in zip(run.p_base, run.levels)]
        m3 = [[_rows(m, lv) for m in ms] for ms, lv in zip(zip(*run.moments), run.levels)] if run.moments \
            else [[] for _ in p3]
        self._land(p3)  # into this state's (the one it was started for) parameters
        self.held, self.last = _key(run.p_base), _Held(run, p3, m3, self.optimizer)
        if int(run.step.state[-1].count.reshape(-1)[0]) < self.zf.warmup_steps:  # the exact update, whole (the
            return params, run.state_after(self._stream(run))    # state's own count: it resumes)
        g3 = [_rows(g if g.shape == p.shape else g.expand(p.shape), lv)
              for g, p, lv in zip(run.g_base, run.p_base, run.levels)]
        if (self.hot is None or self.since >= self.zf.select_interval) and not self.count:
            self._write_back(m3)
            self._select(g3, m3)
        found = self._update_hot(run, p3, g3)
        self._sum(run.g_base, run.step.inv_scale)
        if self.count == self.zf.update_interval:
            self._start()
        self.since += 1
        return params, run.state_after(found)

    # -- the pieces --------------------------------------------------------------------------

    def _check(self, key: tuple) -> None:
        if self.held is not None and self._holds() and key != self.held:
            raise RuntimeError(
                "zenflow: the step holds the update in flight, the summed cold gradients and the hot rows' "
                "moments of the state it returned last, and was given another state. Pass the state the step "
                "returned, call step.settle(state) on that state first, or load a checkpoint with step.load")

    def _holds(self) -> bool:
        return self.pending is not None or self.hot is not None or self.count > 0

    def _sum(self, g_base: list[torch.Tensor], inv_scale: float | torch.Tensor) -> None:
        """This step's gradients, times its clipping factor, into the interval's host sums
        (copied in full before the host reads them: a GPU's copies are waited for)."""
        scale = float(inv_scale)
        if self.summed is None:
            self.summed = [g.detach().to("cpu", copy=True).contiguous() for g in g_base]
            if scale != 1.0:
                for acc in self.summed:
                    acc.mul_(scale)
        else:
            for acc, g in zip(self.summed, g_base):
                g = g.detach().to("cpu").reshape(acc.shape)
                acc.add_(g * scale if scale != 1.0 else g)
        self.count += 1

    def _start(self) -> None:
        """The tier's update of the interval's mean gradient, in a thread, on host copies
        of the parameters as they are now (their cold rows do not change until it lands)."""
        summed, n = self.summed, self.count
        self.summed, self.count = None, 0
        if n > 1:
            for acc in summed:
                acc.div_(n)
        held = self.last
        pin = self.offload.pin_memory and torch.cuda.is_available()
        copies = [_host_copy(p, pin) for p in held.p3]
        ready = None
        if any(p.device.type == "cuda" for p in held.p3):
            ready = torch.cuda.Event()
            ready.record()
        self.pending = _Pending(held, copies, summed, self.offload, ready)

    def _land(self, p3: list[torch.Tensor]) -> None:
        """The update in flight into ``p3``'s cold rows (its hot rows are newer)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        for p, host, hot in zip(p3, pending.wait(), self.hot):
            idx, _ = hot
            if idx.shape[1] == p.shape[1]:  # every row hot: nothing of the host's to take
                continue
            h = host.view(p.shape)  # (a host copy of p: its shape)
            if idx.shape[1]:
                ie = idx.unsqueeze(-1).expand(*idx.shape, p.shape[2])
                h.scatter_(1, ie.to(h.device), p.gather(1, ie).to(h.device))
            p.copy_(h, non_blocking=True)

    def _write_back(self, m3: list[list[torch.Tensor]]) -> None:
        """The hot rows' device moments into their rows of the tier's (which the host
        update went over with values of its own while they were hot)."""
        if self.hot is None:
            return
        for ms, (idx, hot) in zip(m3, self.hot):
            if idx.shape[1]:
                for m, h in zip(ms, hot):
                    ie = idx.unsqueeze(-1).expand(*idx.shape, m.shape[2]).to(m.device)
                    # (an NVMe tier's moment: read, its rows put in, written back, checksummed)
                    whole = _offload.fetch(m)
                    whole.scatter_(1, ie, h.to(m.device))
                    if whole is not m:
                        _offload.store(m, whole)
        self.hot = None

    def _select(self, g3: list[torch.Tensor], m3: list[list[torch.Tensor]]) -> None:
        """The hot rows of each shard: its ``topk_ratio`` of rows by gradient L1 norm (the
        row index sorted), their moments fetched from the tier to the device."""
        self.hot = []
        for g, ms in zip(g3, m3):
            k = self.zf.rows(g.shape[1])
            if k == g.shape[1]:
                idx = torch.arange(k, device=g.device).expand(g.shape[0], k)
            else:
                idx = g.abs().sum(-1).topk(k, dim=1).indices.sort(dim=1).values
            ie = idx.unsqueeze(-1).expand(*idx.shape, g.shape[2])
            self.hot.append((idx, [_offload.fetch(m).gather(1, ie.to(m.device)).to(g.device) for m in ms]))
        self.since = 0

    def _update_hot(self, run: _Run, p3: list[torch.Tensor], g3: list[torch.Tensor]) -> torch.Tensor:
        """The fused kernel on the hot rows (gathered, updated, scattered back)."""
        ps, gs, ms, flags, back = [], [], [[] for _ in run.moments], [], []
        for i, (p, g, (idx, hot)) in enumerate(zip(p3, g3, self.hot)):
            if not idx.shape[1]:
                continue
            ie = idx.unsqueeze(-1).expand(*idx.shape, p.shape[2])
            ph = p.gather(1, ie)
            back.append((p, ie, ph))
            ps.append(ph.view(-1))
            gs.append(g.gather(1, ie).reshape(-1))
            for j, h in enumerate(hot):
                ms[j].append(h.view(-1))
            flags.append(True if run.decay is None else run.decay[i])
        found = run.step.run(ps, gs, ms, None if run.decay is None else flags) if ps else \
            torch.zeros((), dtype=torch.bool)
        for p, ie, ph in back:
            p.scatter_(1, ie, ph)
        return found

    def settle(self, params: Any = None) -> None:
        """Put what the step holds for the state it returned last into it (``params``: that
        state's parameters, checked; None: the state it holds, whichever): the update in
        flight lands, the gradients summed so far are applied as an interval of their own
        (their update run and landed now), the hot rows' moments go back to the tier, and
        the next step selects afresh. Another state is an error."""
        if not self._holds():
            return
        if params is not None and \
                not set(self.held) <= set(_key([beneath(t)[0] for t in optree.tree_leaves(params)])):
            self._check(())
        held = self.last
        self._land(held.p3)
        if self.count:
            self._start()
            self._land(held.p3)
        self._write_back(held.m3)
        self.held = self.last = None
