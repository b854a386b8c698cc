"""The update a step runs: ``PureUpdate`` (new tensors), ``DonatedUpdate`` (in place),
``FusedUpdate`` (the in-place multi-tensor kernel), ``CopiedFusedUpdate`` (that kernel on
new copies: pure) or ``StackedFusedUpdate`` (the same
beneath the virtual mesh's vmap levels). Each takes the clipping factor the step's gradient
transformation computed (``step._transform``): the functional form multiplies the gradients
by it, the fused kernels apply it as the gradients load (``inv_scale``)."""

from __future__ import annotations

import contextlib
from typing import Any

import optree
import torch

from fsharded import optim
from fsharded.parallel import offload as _offload
from fsharded.spmd import _manifest
from fsharded.spmd._virtual import beneath

__all__ = ["PureUpdate", "DonatedUpdate", "FusedUpdate", "CopiedFusedUpdate", "StackedFusedUpdate",
           "CopiedStackedFusedUpdate", "OffloadedUpdate", "HostUpdate", "choose_update", "tiered", "tiered_params"]


class PureUpdate:
    """``optimizer.update`` + ``apply_updates`` on the gradients times the clipping factor
    (None: not clipped): new tensors, the old state stays valid."""

    def __init__(self, optimizer: Any, eager: bool) -> None:
        self.optimizer, self.eager = optimizer, eager

    def _clip(self, grads: Any, factor: torch.Tensor | None) -> Any:
        if factor is None:
            return grads
        if not self.eager:  # per leaf: foreach kernels have no batching rule
            return optree.tree_map(lambda t: t * factor.to(t.dtype), grads)
        leaves, tdef = optree.tree_flatten(grads)
        return optree.tree_unflatten(tdef, torch._foreach_mul(leaves, factor))

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        """``factor``: the clipping factor (0-d, the same on every shard), None without
        clipping. ``ok``: the step's finite verdict (the same on every shard), for the
        in-place forms to skip on; the pure form's result is dropped by the caller instead."""
        updates, opt_state = self.optimizer.update(self._clip(grads, factor), opt_state, params)
        return optim.apply_updates(params, updates), opt_state


def _skip(ok: torch.Tensor | None) -> bool:
    """Whether an in-place update must not run: a non-finite step (a host read of a 0-d
    flag; the fused kernels read the clipping factor on the host anyway)."""
    if ok is None or _manifest.dry():
        return False
    return not bool(beneath(ok)[0].reshape(-1)[0])  # every device's copy is the same verdict


class DonatedUpdate(PureUpdate):
    """The pure update allowed to overwrite the parameters and moments in place (the state
    passed in is consumed, like JAX's donated buffers): for optimizers without a fused form."""

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _skip(ok):  # the state stays the last good one
            return params, opt_state
        with optim.donating():
            return super().__call__(grads, factor, opt_state, params)


class FusedUpdate(PureUpdate):
    """Donated fp32 state with adamw / adam / lion: one fused in-place multi-tensor kernel
    (Triton on CUDA, C++ on CPU) with the clipping factor applied as the gradients load.
    A dry run takes the pure form, which communicates the same."""

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry():
            return super().__call__(grads, factor, opt_state, params)
        if _skip(ok):
            return params, opt_state
        # No inf/nan check in the kernel: the pure form does not skip non-finite steps
        # either, and donation is refused with fp16 loss scaling (which would need it).
        opt_state, _ = optim.fused_update_(self.optimizer, grads, opt_state, params,
                                           inv_scale=1.0 if factor is None else factor, check_finite=False)
        return params, opt_state


class StackedFusedUpdate(FusedUpdate):
    """``FusedUpdate`` on the virtual mesh: the same in-place kernel on the tensors beneath
    the vmap levels (``_virtual.beneath``), each holding every device's shard of a leaf,
    so one call updates all devices' shards as each device updates its own (the update is
    elementwise). The state passed in is consumed, as on real ranks, and the step holds
    what a device holds instead of the old and new state side by side.

    A leaf whose gradient is laid out otherwise than its parameter takes the parameter's
    levels: a gradient copy per device that the typing says is invariant is read once; one
    invariant where the parameter varies is broadcast. Moments laid out otherwise than
    their parameter (not made by this step's init) take the pure form."""

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry():
            return PureUpdate.__call__(self, grads, factor, opt_state, params)
        if _skip(ok):
            return params, opt_state
        p_leaves, p_def = optree.tree_flatten(params)
        s_leaves, s_def = optree.tree_flatten(opt_state)
        p_base = [beneath(x) for x in p_leaves]
        g_base = [_aligned(beneath(g), b) for g, b in zip(optree.tree_leaves(grads), p_base)]
        s_base = [beneath(x) if isinstance(x, torch.Tensor) else (x, ()) for x in s_leaves]
        of = {id(x): b for x, b in zip(s_leaves, s_base)}
        moments = opt_state[self.optimizer.fused.moments]
        fields = [moments.mu] + ([moments.nu] if hasattr(moments, "nu") else [])
        for tree in fields:
            for m, (b, lv) in zip(optree.tree_leaves(tree), p_base):
                mb, m_lv = of[id(m)]
                if m_lv != lv or mb.shape != b.shape:
                    return PureUpdate.__call__(self, grads, factor, opt_state, params)
        # The kernel wants contiguous tensors: a strided view (a leaf sharded on an inner
        # dim) is updated in a contiguous copy and written back.
        back: list[tuple[torch.Tensor, torch.Tensor]] = []

        def dense(b: torch.Tensor) -> torch.Tensor:
            if b.is_contiguous():
                return b
            c = b.contiguous()
            back.append((b, c))
            return c

        plain_p = [dense(b) for b, _ in p_base]
        plain_s = [dense(b) if isinstance(b, torch.Tensor) and b.dim() > 0 else b for b, _ in s_base]
        # Invariant: every device's copy is the same number.
        inv_scale = 1.0 if factor is None else float(beneath(factor)[0].reshape(-1)[0])
        new_s, _ = optim.fused_update_(
            self.optimizer, optree.tree_unflatten(p_def, g_base), optree.tree_unflatten(s_def, plain_s),
            optree.tree_unflatten(p_def, plain_p), inv_scale=inv_scale, check_finite=False,
            decay=optim.decay_flags(self.optimizer, params))  # read on the leaves as the mask sees them
        for b, c in back:
            b.copy_(c)
        # Hand back the wrappers of what was updated in place, and the new counters.
        ids = {id(c): w for c, w in zip(plain_s, s_leaves)}
        out = [ids.get(id(x), x) for x in optree.tree_leaves(new_s)]
        return params, optree.tree_unflatten(optree.tree_structure(new_s), out)


class _OnCopies:
    """A fused in-place update made pure: the kernel runs on new copies of the parameters
    and moments (one copy per tensor instead of the functional form's temporaries per
    element-wise op), so the old state stays valid."""

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry():
            return PureUpdate.__call__(self, grads, factor, opt_state, params)
        copy = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
        return super().__call__(grads, factor, optree.tree_map(copy, opt_state),
                                optree.tree_map(copy, params), ok=ok)


class CopiedFusedUpdate(_OnCopies, FusedUpdate):
    """The pure update of a fused-form optimizer (adamw / adam / lion, fp32) on one device
    or a rank: ``FusedUpdate`` on copies."""


class CopiedStackedFusedUpdate(_OnCopies, StackedFusedUpdate):
    """The same on the virtual mesh: ``StackedFusedUpdate`` on copies (a copy of a value
    under the vmap levels is a new tensor beneath them)."""


class OffloadedUpdate(PureUpdate):
    """The fused update with the optimizer's moments in a memory tier (host memory or NVMe
    files, ``parallel.offload``): streamed bucket by bucket through host staging buffers
    (``offload.stream_update``), on a real rank's shards or, on the virtual mesh, beneath
    the vmap levels (as ``StackedFusedUpdate``). The same numbers as ``FusedUpdate``, bit
    for bit. The moments are updated in place in their tier (the state passed in is
    consumed); the parameters too with ``donate``, else the step returns new ones. A dry
    run leaves the state as it is: the update communicates nothing, and reading the tier
    there would bring the state back into memory (its result is dropped anyway). With the
    parameters in a tier too (``offload_params``), they are updated in place there whatever
    ``donate`` says."""

    def __init__(self, optimizer: Any, eager: bool, offload: Any, donate: bool) -> None:
        super().__init__(optimizer, eager)
        self.offload, self.donate = offload, donate

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry() or _skip(ok):
            return params, opt_state
        if not self.donate and self.offload.params is None:
            # New parameters (a copy of a value under the vmap levels is new beneath them);
            # parameters in a tier are updated there, as the moments are.
            params = optree.tree_map(lambda t: t.clone(), params)
        run = self._inputs(grads, factor, opt_state, params)
        return params, run.state_after(self._stream(run))

    def _stream(self, run: _Run) -> torch.Tensor:
        """``offload.stream_update`` of every leaf of ``run``; its found_inf."""
        back: list[tuple[torch.Tensor, torch.Tensor]] = []  # strided leaves, updated in contiguous copies
        flat_p = []
        for b in run.p_base:
            c = b if b.is_contiguous() else b.contiguous()
            if c is not b:
                back.append((b, c))
            flat_p.append(c.view(-1))
        flat_g = [g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1) for g in run.g_base]
        found = _offload.stream_update(run.step, flat_p, flat_g, [[m.view(-1) for m in ms] for ms in run.moments],
                                       run.decay, self.offload)
        for b, c in back:
            b.copy_(c)
        return found

    def _inputs(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any) -> _Run:
        """This update's tensors beneath the vmap levels, checked: the moments in their
        tier and laid out as their parameters."""
        p_leaves = optree.tree_leaves(params)
        s_leaves, s_def = optree.tree_flatten(opt_state)
        p_base = [beneath(x) for x in p_leaves]
        g_base = [_aligned(beneath(g), b) for g, b in zip(optree.tree_leaves(grads), p_base)]
        s_base = [beneath(x)[0] if isinstance(x, torch.Tensor) else x for x in s_leaves]
        inv_scale = 1.0 if factor is None else float(beneath(factor)[0].reshape(-1)[0])
        step = optim.FusedStep(self.optimizer, optree.tree_unflatten(s_def, s_base), inv_scale=inv_scale)
        moments = step.moment_leaves()
        for ms in moments:
            for m, (b, _) in zip(ms, p_base):
                if m.shape != b.shape or not m.is_contiguous():
                    raise NotImplementedError(
                        "offload: an optimizer moment laid out otherwise than its parameter (on the virtual mesh, "
                        "a leaf sharded on an inner dim) cannot be streamed yet; shard it on its first dim, or run "
                        "on real ranks")
                if not _offload.in_tier(m, self.offload):
                    raise RuntimeError(f"offload: the optimizer state is not in its tier "
                                       f"({self.offload.describe()}): make it with step.init(params) or step.load")
        if self.offload.params is not None and not all(_offload.in_tier(b, self.offload, tier=self.offload.params)
                                                       for b, _ in p_base):
            raise RuntimeError(f"offload: the parameters are not in their tier ({self.offload.describe()}): make "
                               f"the state with step.init(params) or step.load")
        return _Run([b for b, _ in p_base], [len(lv) for _, lv in p_base], g_base, s_leaves, s_base, step,
                    moments, optim.decay_flags(self.optimizer, params))


class _Run:
    """One offloaded update's tensors beneath the vmap levels: ``p_base`` (each parameter
    with one leading dim per level: ``levels`` of them), ``g_base`` (its gradient, aligned
    to it), ``moments`` (per moment, one tensor per leaf, in the tier), the ``FusedStep``
    and the decay flags."""

    def __init__(self, p_base: list, levels: list[int], g_base: list, s_leaves: list, s_base: list,
                 step: Any, moments: list, decay: list[bool] | None) -> None:
        self.p_base, self.levels, self.g_base, self.s_leaves, self.s_base = p_base, levels, g_base, s_leaves, s_base
        self.step, self.moments, self.decay = step, moments, decay

    def state_after(self, found: torch.Tensor) -> Any:
        """The new optimizer state: the moments' wrappers (updated in place), new counters."""
        new_s = self.step.finish(found)
        ids = {id(b): w for b, w in zip(self.s_base, self.s_leaves)}
        out = [ids.get(id(x), x) for x in optree.tree_leaves(new_s)]
        return optree.tree_unflatten(optree.tree_structure(new_s), out)


def _aligned(g: tuple[torch.Tensor, tuple[int, ...]], p: tuple[torch.Tensor, tuple[int, ...]]) -> torch.Tensor:
    """The gradient beneath its levels, with its parameter's levels (a view: the fused
    update copies strided gradients a group at a time)."""
    (gb, g_lv), (pb, p_lv) = g, p
    if not g_lv and not p_lv and gb.shape == pb.shape:  # both the same on every device
        return gb
    for i in reversed(range(len(g_lv))):
        if g_lv[i] not in p_lv:  # copies of an invariant gradient: one of them
            gb = gb.select(i, 0)
    kept = [lv for lv in g_lv if lv in p_lv]
    for i, lv in enumerate(p_lv):
        if lv not in kept:  # invariant where the parameter varies: the same for every shard
            gb = gb.unsqueeze(i)
            kept.insert(i, lv)
    return gb.expand(pb.shape)


def tiered(optimizer: Any, opt_state: Any, offload: Any) -> Any:
    """``opt_state`` with its moments (the tensors shaped like parameters) in ``offload``'s
    optimizer tier (``parallel.offload.place``); unchanged without one. An optimizer with a
    fused form says which entries are its moments; one without (the host tier only) has
    every tensor of its state that is not a scalar placed there."""
    if offload is None or not offload.active:
        return opt_state
    form = getattr(optimizer, "fused", None)
    if not isinstance(form, optim.FusedForm):
        _host_only(offload)
        leaves, tdef = optree.tree_flatten(opt_state)
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.dim() > 0]
        placed = _offload.place([leaves[i] for i in where], offload)
        for i, x in zip(where, placed):
            leaves[i] = x
        return optree.tree_unflatten(tdef, leaves)
    moments = opt_state[form.moments]
    fields = [f for f in ("mu", "nu") if hasattr(moments, f)]
    placed = {}
    for f in fields:
        leaves, tdef = optree.tree_flatten(getattr(moments, f))
        placed[f] = optree.tree_unflatten(tdef, _offload.place(leaves, offload))
    out = list(opt_state)
    out[form.moments] = moments._replace(**placed)
    return tuple(out) if type(opt_state) is tuple else type(opt_state)(*out)


def _host_only(offload: Any) -> None:
    """An optimizer without a fused form runs its update on host copies: the host tier
    only, and the parameters in device memory."""
    if offload.optimizer != "cpu" or offload.params is not None or offload.zenflow is not None:
        raise NotImplementedError(
            f"{offload.describe()}: an optimizer without a fused form (fs.optim.adamw, adam or lion, not wrapped in "
            f"a chain) is updated on host copies, with its state in host memory (offload_optimizer='cpu', the "
            f"parameters in device memory, no zenflow); the NVMe tier, parameter offload and ZenFlow stream the "
            f"state through the fused kernel")


class HostUpdate(PureUpdate):
    """An optimizer without a fused form with its state in host memory (the host tier):
    the gradients and parameters are copied to the host, the optimizer's own update runs
    there (in place on the state where the step runs eagerly, pure beneath the virtual
    mesh's vmap), and the new parameters are copied back. What it changes, numerically:
    nothing (the same ops on the same values, on the host). A dry run leaves the state as
    it is, as ``OffloadedUpdate`` does."""

    def __init__(self, optimizer: Any, eager: bool, offload: Any, donate: bool) -> None:
        super().__init__(optimizer, eager)
        self.offload, self.donate = offload, donate

    def __call__(self, grads: Any, factor: torch.Tensor | None, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry() or (self.eager and _skip(ok)):  # (pure: the caller drops a skipped result)
            return params, opt_state
        for x in optree.tree_leaves(opt_state):
            if isinstance(x, torch.Tensor) and x.dim() > 0 and beneath(x)[0].device.type != "cpu":
                raise RuntimeError(f"offload: the optimizer state is not in its tier ({self.offload.describe()}): "
                                   f"make it with step.init(params) or step.load")
        host = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731 - a real copy, on a CPU device too
        hp, hg = optree.tree_map(host, params), optree.tree_map(host, grads)
        with optim.donating() if self.eager else contextlib.nullcontext():  # the state: in place, in its tier
            new_hp, opt_state = super().__call__(hg, None if factor is None else factor.to("cpu"), opt_state, hp)
        if self.donate and self.eager:
            for p, n in zip(optree.tree_leaves(params), optree.tree_leaves(new_hp)):
                p.copy_(n, non_blocking=True)
            return params, opt_state
        return optree.tree_map(lambda n, p: n.to(p.device, copy=True), new_hp, params), opt_state


def tiered_params(params: Any, offload: Any) -> Any:
    """``params`` (the master weights) with their fp32 leaves in ``offload``'s parameter
    tier (``parallel.offload.place_params``); unchanged without one."""
    if offload is None or offload.params is None:
        return params
    leaves, tdef = optree.tree_flatten(params)
    return optree.tree_unflatten(tdef, _offload.place_params(leaves, offload))


def choose_update(optimizer: Any, *, donate: bool, eager: bool, params: Any, offload: Any = None,
                  graph: bool = False) -> PureUpdate:
    """The update a step runs: the pure form in a step captured as one graph (``graph``:
    the compiler fuses its element-wise ops; no kernel reading scalars on the host);
    streamed through host buffers where the optimizer state is in a memory tier
    (``offload``); fused where the state is donated, plain fp32 tensors and the optimizer
    has a fused form (beneath the vmap levels on the virtual mesh); in place where
    donated; else pure."""
    if graph:
        return PureUpdate(optimizer, eager=False)
    fused = optim.has_fused(optimizer) and all(t.dtype == torch.float32 for t in optree.tree_leaves(params))
    if offload is not None and offload.active:
        if not fused:
            _host_only(offload)
            return HostUpdate(optimizer, eager, offload, donate)
        return OffloadedUpdate(optimizer, eager, offload, donate)
    if donate and fused:
        return FusedUpdate(optimizer, eager) if eager else StackedFusedUpdate(optimizer, eager)
    if fused:
        return CopiedFusedUpdate(optimizer, eager) if eager else CopiedStackedFusedUpdate(optimizer, eager)
    if donate and eager:
        return DonatedUpdate(optimizer, eager)
    return PureUpdate(optimizer, eager)
