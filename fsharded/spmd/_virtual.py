"""shard_map on the virtual mesh: every mesh axis a ``torch.func.vmap`` level, in one process.

Each axis' level vmaps a token ``arange(n)``; a collective finds its axis' level as the
one where the token is batched (see ``_prims.Collective.vmap``). Values batched at a
level vary over that axis; the varying-axes table (``_vma``) types them by rules as on
real ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from fsharded import _memory_hooks as memory
from fsharded.mesh._layout import from_stacked, to_stacked
from fsharded.spmd import _env, _manifest, _prims, _vma
from fsharded.spmd._env import Axes

_F = torch._C._functorch


def call(sm: Any, args: tuple) -> Any:
    mesh = sm.mesh
    names = mesh.axis_names
    if mesh.size == 1:
        return _single(sm, args)
    leaves, specs, treedef, _ = sm._flat_in(args)
    is_t = [isinstance(x, torch.Tensor) for x in leaves]
    mem = memory.per_device()
    since = mem.clock if mem is not None else None
    # Only the leaves a spec splits go through vmap; the rest (unbatched at every level)
    # reach the body as they are, by closure, as vmap would pass them with in_dims None.
    # Without the memory tracker they are not relaid (their stacked form is themselves).
    split = [t and bool(s.axes) for s, t in zip(specs, is_t)]
    stacked = [to_stacked(x, s, mesh) if t and (sp or mem is not None) else x
               for x, s, t, sp in zip(leaves, specs, is_t, split)]
    dev = next((x.device for x, t in zip(leaves, is_t) if t), torch.device("cpu"))
    tokens = [torch.arange(n, device=dev) for n in mesh.axis_sizes]
    if mem is not None:  # per device: what each stored value holds one copy per device of
        for x, st, s, t in zip(leaves, stacked, specs, is_t):
            if t:
                mem.tag(x, s.axes, layout=True)  # a global value laid out by its spec
                mem.tag(st, s.axes, since=since)
        for a, tok in zip(names, tokens):
            mem.tag(tok, (a,), since=since)
    moving = [st for st, sp in zip(stacked, split) if sp]
    out_info: dict[str, Any] = {}

    def body(tok_list, moved):
        toks = dict(zip(names, tok_list))
        levels = {_F.maybe_get_level(t): a for a, t in toks.items()}
        it = iter(moved)
        flat = [next(it) if sp else st for st, sp in zip(stacked, split)]
        frame, mode = _typed_frame(_env.AxisFrame(mesh, "virtual", tokens=toks), levels)
        with _env.enter(frame), mode:
            o_leaves, o_specs, o_def, kinds = _vma.run_body(mode, sm, flat, specs, treedef)
            res = []
            for y, (_, undeclared) in zip(o_leaves, kinds):
                for a in undeclared:  # check_vma=False: shard 0's value along the axis
                    y = _take_replica(y, frame, a)
                res.append(y)
        # A plain tensor under an empty spec is the output itself on every device: it
        # leaves by closure too (vmap would broadcast it, and the copies are dropped).
        kept = {i: y for i, (y, s) in enumerate(zip(res, o_specs))
                if mem is None and not s.axes and isinstance(y, torch.Tensor)
                and not _F.is_functorch_wrapped_tensor(y)}
        out_info.update(o_def=o_def, o_specs=o_specs, kept=kept)
        return [y for i, y in enumerate(res) if i not in kept]

    # One vmap level per mesh axis, the first axis outermost. Every output comes back
    # with a leading dim per axis (vmap broadcasts values that do not vary along it).
    fn = body
    for i in reversed(range(len(names))):
        tok_dims = [0 if j == i else None for j in range(len(names))]
        arg_dims = [0 if names[i] in s.axes else None for s, sp in zip(specs, split) if sp]
        fn = torch.func.vmap(fn, in_dims=(tok_dims, arg_dims), out_dims=0, randomness=sm.randomness)
    res = iter(fn(tokens, moving))
    kept = out_info["kept"]
    outs = []
    for i, s in enumerate(out_info["o_specs"]):
        if i in kept:
            outs.append(kept[i])
            continue
        y = next(res)
        named = set(s.axes)
        # Drop the (broadcast) dims of axes the output is invariant over.
        for k in reversed(range(len(names))):
            if names[k] not in named:
                y = y.select(k, 0)
        outs.append(from_stacked(y, s, mesh))
    return optree.tree_unflatten(out_info["o_def"], outs)


def _single(sm: Any, args: tuple) -> Any:
    """A one-device mesh: every collective is the identity, so skip vmap altogether, and
    the typing (nothing can differ between devices: out_specs are not checked here)."""
    leaves, specs, treedef, _ = sm._flat_in(args)
    zeros = {a: torch.zeros((), dtype=torch.int64) for a in sm.mesh.axis_names}
    with _env.enter(_env.AxisFrame(sm.mesh, "virtual", tokens=zeros)):
        o_leaves, _, o_def, _ = sm._flat_out(sm.f(*optree.tree_unflatten(treedef, leaves)))
    return optree.tree_unflatten(o_def, o_leaves)


def _typed_frame(frame: _env.AxisFrame, levels: dict) -> tuple[_env.AxisFrame, _vma.VmaMode]:
    mode = _vma.VmaMode(frame.mesh.axis_names, _prims.implicit_pvary(frame), levels)
    return dataclasses.replace(frame, vma=mode), mode


def _take_replica(y: torch.Tensor, frame: _env.AxisFrame, axis: str) -> torch.Tensor:
    axes = Axes((axis,), (frame.mesh.shape[axis],), frame)
    return _prims.Collective.apply(_prims.REPLICA, (), axes, y, frame.tokens[axis])


def beneath(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The plain tensor beneath ``t``'s vmap levels, as a view with one leading dim per
    level ``t`` is batched at (outermost level first), and those levels.

    Inside a virtual-mesh body each value is every device's shard at once: beneath the
    levels it is one tensor holding all of them (for a shard_map input, a view of the
    global value's storage). An elementwise in-place update written there updates every
    device's shard, as each device would its own (``step._update.StackedFusedUpdate``)."""
    if not _F.is_batchedtensor(t):  # a value the same on every device (the common case)
        return t, ()
    chain = []  # (level, bdim), innermost (highest) level first
    while _F.is_batchedtensor(t):
        chain.append((_F.maybe_get_level(t), _F.maybe_get_bdim(t)))
        t = _F.get_unwrapped(t)
    # Place each level's dim among the dims beneath it, from the top level down: a level's
    # bdim indexes the dims of the value one level below (which include the levels under it).
    order: list = list(range(t.dim() - len(chain)))  # the logical (shard) dims, by id
    for level, bdim in chain:
        order.insert(bdim, ("level", level))
    levels = sorted(lv for lv, _ in chain)
    lead = [order.index(("level", lv)) for lv in levels]
    rest = [i for i, d in enumerate(order) if not isinstance(d, tuple)]
    return t.permute(lead + rest), tuple(levels)



def pmean_beneath(xs: list[torch.Tensor], axes: Axes) -> list[torch.Tensor] | None:
    """Each of ``xs`` averaged over ``axes``, computed beneath the vmap levels: plain
    tensors (the same on every device, which is what an unbatched value inside the body
    is). What ``pmean`` of the flat bucket of ``xs`` gives, bit for bit, without a vmapped
    op per leaf and without the bucket: over an axis of 2 devices, one addition per
    element (in any layout) and a halving (exact), per leaf. Recorded in an open manifest
    as that one collective over the bucket.

    None where it does not apply, and the caller runs the collective: an axis of another
    size (a sum of more terms depends on the layout's order), a reduction over several
    axes, operands batched at other levels than ``axes``' alone (the result would still
    vary), typed otherwise than varying over ``axes`` alone, differentiated, inside other
    torch.func wrappers, in a dry run, or under a per-device memory tracker (which counts
    the vmapped form)."""
    frame = axes.frame
    mode = frame.vma
    if (len(axes.names) != 1 or axes.size != 2 or not axes.virtual or frame.mesh.size == 1 or _manifest.dry()
            or memory.per_device() is not None or mode is None or mode.dispatching or mode.assumed is not None
            or (torch.is_grad_enabled() and any(x.requires_grad for x in xs))):
        return None
    want = frozenset(axes.names)
    level = next((lv for lv, a in mode.levels.items() if a == axes.names[0]), None)
    plain = []
    for x in xs:
        if not _F.is_batchedtensor(x) or _F.maybe_get_level(x) != level or mode.get(x) != want:
            return None
        b = _F.get_unwrapped(x)
        if _F.is_functorch_wrapped_tensor(b):
            return None
        plain.append((b, _F.maybe_get_bdim(x)))
    with torch._C.DisableTorchFunction():  # the collective's own ops: not the program's, untyped
        out = [b.sum(d, dtype=b.dtype) for b, d in plain]
        torch._foreach_div_(out, axes.size)
        bucket = torch.empty(sum(y.numel() for y in out), dtype=out[0].dtype, device="meta")
    _manifest.record(_prims.PSUM, (), axes, bucket)
    for y in out:
        mode.set(y, frozenset())
    return out
