"""``shard_map``: run a per-shard function over a mesh, on either backend.

>>> mesh = Mesh({"data": 2})
>>> f = shard_map(lambda x: psum(x.sum(), "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
>>> f(torch.arange(4.0))
tensor(6.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import _env, _manifest, _tree
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._shard import (
    _backend,
    check_tree,
    from_stacked,
    to_stacked,
)
from fsharded.mesh._spec import PartitionSpec

__all__ = ["shard_map", "ShardMapped"]


def shard_map(
    f: Callable,
    /,
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    check_rep: bool = False,
    backend: str | None = None,
    randomness: str = "error",
) -> ShardMapped:
    """Map ``f`` over the shards of its arguments on ``mesh``.

    ``in_specs`` is a tuple with one spec tree (or prefix) per positional argument —
    a single spec is accepted when ``f`` takes one argument. Each tensor argument is
    split by its spec; ``f`` runs once per device on its shard and may call the
    collectives (``psum``, ``all_gather``, ...) over the mesh axes. Outputs are
    reassembled into global tensors by ``out_specs``; an output replicated over an axis
    (its spec does not name it) takes the value of shard 0 along that axis, and with
    ``check_rep=True`` every replica is checked to be equal.

    ``backend``: ``"virtual"`` (nested ``torch.func.vmap``, one level per mesh axis, in
    one process) or ``"distributed"`` (one rank per device, under ``torchrun``). By
    default, distributed when a process group is initialised. ``randomness`` is passed to
    vmap (``"error" | "different" | "same"``).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_map: mesh must be a fsharded.Mesh, got {type(mesh).__name__}")
    return ShardMapped(f, mesh, in_specs, out_specs, check_rep, backend, randomness)


class ShardMapped:
    """The callable returned by ``shard_map``; ``.collectives(*args)`` gives its manifest."""

    def __init__(self, f, mesh, in_specs, out_specs, check_rep, backend, randomness):
        self.f, self.mesh = f, mesh
        self.in_specs, self.out_specs = in_specs, out_specs
        self.check_rep, self.backend, self.randomness = check_rep, backend, randomness
        self._cache: dict = {}
        functools.update_wrapper(self, f)

    def __repr__(self) -> str:
        return f"shard_map({getattr(self.f, '__name__', self.f)!r}, mesh={self.mesh!r})"

    # -- argument handling ----------------------------------------------------------------

    def _flat_in(self, args: tuple, *, local: bool = False) -> tuple[list, list, Any, list[str]]:
        leaves, treedef = optree.tree_flatten(args)
        key = ("in", local, treedef, _signature(leaves))
        hit = self._cache.get(key)
        if hit is not None:
            return leaves, hit[0], treedef, hit[1]
        specs = self.in_specs
        if isinstance(specs, PartitionSpec) or specs is None:
            specs = (specs,) * len(args) if len(args) == 1 else specs
        if isinstance(specs, list):
            specs = tuple(specs)
        if not isinstance(specs, tuple) or len(specs) != len(args):
            raise ValueError(
                f"shard_map: in_specs must be a tuple with one entry per positional argument "
                f"({len(args)} given), got {self.in_specs!r}"
            )
        paths = [_argpath(p) for p in _tree.tree_flatten_with_paths(args)[0]]
        flat_specs = _tree.broadcast_prefix(specs, args, what="in_specs", name=_argpath)
        if local:  # shard shapes: only the axes and ranks can be checked
            check_tree_local(leaves, flat_specs, paths, self.mesh, "shard_map in_specs")
        else:
            check_tree(leaves, flat_specs, paths, self.mesh, "shard_map in_specs")
        self._remember(key, (flat_specs, paths))
        return leaves, flat_specs, treedef, paths

    def _flat_out(self, out: Any) -> tuple[list, list, Any, list[str]]:
        leaves, treedef = optree.tree_flatten(out)
        key = ("out", treedef, _signature(leaves))
        hit = self._cache.get(key)
        if hit is not None:
            return leaves, hit[0], treedef, hit[1]
        paths = [_outpath(p) for p in _tree.tree_flatten_with_paths(out)[0]]
        flat_specs = _tree.broadcast_prefix(self.out_specs, out, what="out_specs", name=_outpath)
        bad = [p for p, x in zip(paths, leaves) if not isinstance(x, torch.Tensor)]
        if bad:
            raise ValueError(f"shard_map: outputs must be tensors; not tensors at {bad}")
        check_tree_local(leaves, flat_specs, paths, self.mesh, "shard_map out_specs")
        self._remember(key, (flat_specs, paths))
        return leaves, flat_specs, treedef, paths

    def _remember(self, key: Any, value: Any) -> None:
        # Checked layouts are memoised per tree structure and shapes: the checks walk every
        # leaf, which costs milliseconds per call on a model-sized tree.
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = value

    # -- call -----------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        backend = _backend(self.mesh, self.backend)
        if backend == "virtual":
            return self._virtual(args)
        from fsharded import _dist_map

        return _dist_map.call(self, args)

    def local(self, *args: Any) -> Any:
        """Call with this rank's shards and get this rank's shards back.

        On the distributed backend nothing is sliced or gathered: arguments are the local
        shards laid out by ``in_specs`` (as ``fsharded.shard`` makes them) and outputs are
        left as shards. Step functions keep their state this way. On the virtual mesh the
        whole mesh lives in one process, so this is the same as calling with global values.
        """
        backend = _backend(self.mesh, self.backend)
        if backend == "virtual":
            return self._virtual(args)
        from fsharded import _dist_map

        return _dist_map.call(self, args, local=True)

    def collectives(self, *args: Any) -> _manifest.Manifest:
        """The collectives one call runs, in order, without running them.

        Runs ``f`` on the virtual mesh over meta tensors of the same shapes (no data, no
        communication) and records every collective: op, axis, dtype, per-shard shape and
        bytes each rank sends. Collectives in a ``torch.func.grad`` inside ``f`` are
        listed with phase ``backward``.
        """
        meta = optree.tree_map(
            lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
            if isinstance(x, torch.Tensor)
            else x,
            args,
        )
        with _manifest.recording() as entries:
            self._virtual(meta, check=False)
        return _manifest.Manifest(entries)

    def _virtual(self, args: tuple, *, check: bool = True) -> Any:
        mesh = self.mesh
        names = mesh.axis_names
        if mesh.size == 1:
            return self._single(args)
        leaves, specs, treedef, _ = self._flat_in(args)
        is_t = [isinstance(x, torch.Tensor) for x in leaves]
        stacked = [to_stacked(x, s, mesh) if t else x for x, s, t in zip(leaves, specs, is_t)]
        dev = next((x.device for x, t in zip(leaves, is_t) if t), torch.device("cpu"))
        tokens = [torch.arange(n, device=dev) for n in mesh.axis_sizes]
        out_info: dict[str, Any] = {}

        def body(tok_list, flat):
            frame = _env.AxisFrame(mesh, "virtual", tokens=dict(zip(names, tok_list)))
            with _env.enter(frame):
                out = self.f(*optree.tree_unflatten(treedef, list(flat)))
                o_leaves, o_specs, o_def, o_paths = self._flat_out(out)
                res, flags = [], []
                for y, s in zip(o_leaves, o_specs):
                    named = set(s.axes)
                    # A plain tensor is batched at no level: replicated everywhere already.
                    varying = torch._C._functorch.is_batchedtensor(y)
                    for a in names:
                        if a not in named:
                            if self.check_rep and check:
                                flags.append(_differs(y, frame, a))
                            if varying:
                                y = _take_replica(y, frame, a)
                    res.append(y)
            out_info.update(o_def=o_def, o_specs=o_specs, o_paths=o_paths)
            return res, flags

        # One vmap level per mesh axis, the first axis outermost. Every output comes back
        # with a leading dim per axis (vmap broadcasts values that do not vary along it).
        fn = body
        for i in reversed(range(len(names))):
            tok_dims = [0 if j == i else None for j in range(len(names))]
            arg_dims = [0 if t and names[i] in s.axes else None for s, t in zip(specs, is_t)]
            fn = torch.func.vmap(
                fn, in_dims=(tok_dims, arg_dims), out_dims=0, randomness=self.randomness
            )
        res, flags = fn(tokens, stacked)
        if flags:
            _raise_if_differs(flags, out_info, names)
        outs = []
        for y, s in zip(res, out_info["o_specs"]):
            named = set(s.axes)
            # Drop the (broadcast) dims of axes the output is replicated over.
            for k in reversed(range(len(names))):
                if names[k] not in named:
                    y = y.select(k, 0)
            outs.append(from_stacked(y, s, mesh))
        return optree.tree_unflatten(out_info["o_def"], outs)


    def _single(self, args: tuple) -> Any:
        """A one-device mesh: every collective is the identity, so skip vmap altogether."""
        self._flat_in(args)
        zeros = {a: torch.zeros((), dtype=torch.int64) for a in self.mesh.axis_names}
        with _env.enter(_env.AxisFrame(self.mesh, "virtual", tokens=zeros)):
            out = self.f(*args)
            self._flat_out(out)
        return out


def _signature(leaves: list) -> tuple:
    return tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in leaves
    )


def _argpath(p: str) -> str:
    # "0.w" -> "args[0].w": name the positional argument in error messages.
    if p == "<root>":
        return "args"
    head, _, rest = p.partition(".")
    return f"args[{head}]" + (f".{rest}" if rest else "")


def _outpath(p: str) -> str:
    return "output" if p == "<root>" else f"output.{p}"


def check_tree_local(leaves, specs, paths, mesh, what) -> None:
    """Spec checks that hold for shards as well as global values: axes and ranks."""
    bad = []
    for path, y, s in zip(paths, leaves, specs):
        errs = list(_spec_axis_errors(s, mesh))
        if not isinstance(y, torch.Tensor):
            if len(s):
                errs.append(f"{type(y).__name__} is not a tensor and cannot be sharded")
        elif len(s) > y.dim():
            errs.append(f"spec has {len(s)} entries but the value has rank {y.dim()}")
        if errs:
            bad.append((path, s, tuple(getattr(y, "shape", ())), errs))
    if bad:
        from fsharded.mesh._spec import format_spec_errors

        raise ValueError(f"{what}: " + format_spec_errors(bad, mesh))


def _spec_axis_errors(spec, mesh):
    errs, seen = [], set()
    for a in spec.axes:
        if a not in mesh.shape:
            errs.append(f"axis {a!r} is not in the mesh (axes: {list(mesh.axis_names)})")
        elif a in seen:
            errs.append(f"axis {a!r} is used twice")
        seen.add(a)
    return errs


def _take_replica(y, frame, axis):
    from fsharded._env import Axes
    from fsharded.collectives import _REPLICA, _Collective

    axes = Axes((axis,), (frame.mesh.shape[axis],), frame)
    return _Collective.apply(_REPLICA, (), axes, y, frame.tokens[axis])


def _differs(y, frame, axis):
    from fsharded.collectives import pmax

    r = _take_replica(y.detach(), frame, axis)
    d = (y.detach() != r) & ~(y.detach().isnan() & r.isnan())
    return pmax(d.any().to(torch.float32), axis)


def _raise_if_differs(flags, out_info, names):
    """``flags`` are per-(leaf, dropped axis) 0/1 tensors, already max-reduced over the axis."""
    msgs = []
    i = 0
    for path, s in zip(out_info["o_paths"], out_info["o_specs"]):
        for a in names:
            if a not in set(s.axes):
                if bool(flags[i].detach().max() > 0):
                    msgs.append(
                        f"  {path}: out_specs {s!r} declare it replicated over {a!r}, but its "
                        f"value differs between shards along {a!r}; add {a!r} to its spec, or "
                        f"reduce it first (psum / pmean / all_gather over {a!r})"
                    )
                i += 1
    if msgs:
        raise ValueError("shard_map(check_rep=True): outputs are not replicated:\n" + "\n".join(msgs))


def _differs_local(y, frame, axis):
    """Distributed check_rep: 1.0 where any element differs between shards along ``axis``."""
    from fsharded import distributed
    from fsharded.collectives import PMAX

    g = distributed.axis_group(frame.mesh, (axis,))
    v = y.detach()
    if v.dtype == torch.bool:
        v = v.to(torch.int32)
    hi = PMAX.dist(v, g, ())
    lo = -PMAX.dist(-v, g, ())
    d = (hi != lo) & ~(hi.isnan() | lo.isnan()) if v.is_floating_point() else hi != lo
    nan_mix = (v.isnan().to(torch.int32) if v.is_floating_point() else torch.zeros_like(v, dtype=torch.int32))
    nm = PMAX.dist(nan_mix, g, ()) - (-PMAX.dist(-nan_mix, g, ()))
    return (d.any() | (nm != 0).any()).to(torch.float32)
