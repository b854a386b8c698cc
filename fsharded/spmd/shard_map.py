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

from fsharded.mesh import _tree
from fsharded.mesh._layout import check_tree, dims
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, format_spec_errors
from fsharded.spmd import _distributed, _manifest, _schedule, _virtual
from fsharded.spmd._transfer import Sharded, backend_for, globals_of

__all__ = ["shard_map", "ShardMapped"]


def shard_map(
    f: Callable | None = None,
    /,
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
    check_rep: bool | None = None,
    backend: str | None = None,
    randomness: str = "error",
) -> ShardMapped:
    """Map ``f`` over the shards of its arguments on ``mesh``.

    ``in_specs`` is a tuple with one spec tree (or prefix) per positional argument —
    a single spec is accepted when ``f`` takes one argument. Each tensor argument is
    split by its spec; ``f`` runs once per device on its shard and may call the
    collectives (``psum``, ``all_gather``, ...) over the mesh axes. Outputs are
    reassembled into global tensors by ``out_specs``.

    Every value in ``f`` has a type: the mesh axes it varies over (JAX's varying manual
    axes; see ``fsharded.spmd._vma``). ``check_vma=True`` (the default, as in JAX) makes an
    out_spec that leaves out an axis its output varies over a ``ValueError`` at the call,
    naming the output; ``check_vma=False`` takes shard 0's value along such axes
    unchecked. An output invariant over an axis its out_spec names is the same on every
    shard along it (its gradient sums the shards' cotangents). ``check_rep`` is accepted
    as the old name of ``check_vma``.

    ``backend``: ``"virtual"`` (nested ``torch.func.vmap``, one level per mesh axis, in
    one process) or ``"distributed"`` (one rank per device, under ``torchrun``). By
    default, distributed when a process group is initialised. ``randomness`` is passed to
    vmap (``"error" | "different" | "same"``).

    Without ``f`` (as ``jax.shard_map`` allows) it returns a decorator:
    ``@shard_map(mesh=mesh, in_specs=P("i"), out_specs=P())`` over a ``def``.

    An output that is a Python number (``bool``, ``int``, ``float``, ``complex``) or a
    numpy value comes back as a tensor (0-d for a number), as JAX returns an array:
    ``shard_map(lambda x: x, mesh=m, in_specs=P(), out_specs=P())(3.0)`` is
    ``tensor(3.)``. Its dtype is torch's for the number (``float`` -> the default dtype,
    ``int`` -> int64, where JAX without x64 gives int32). Arguments that are numbers
    reach ``f`` unchanged (they are not split; usable as sizes or flags), as do numpy
    scalars; a numpy array argument is a tensor (``torch.as_tensor``, its dtype kept), split
    by its spec like any other.
    """
    if f is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma, check_rep=check_rep, backend=backend,
                                 randomness=randomness)
    if not callable(f):
        raise TypeError(f"shard_map: f must be a function, got {type(f).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_map: mesh must be a fsharded.Mesh, got {type(mesh).__name__}")
    if check_rep is not None:
        if check_vma is not True and bool(check_rep) != bool(check_vma):
            raise ValueError(
                f"shard_map: check_rep={check_rep!r} and check_vma={check_vma!r} disagree; "
                f"check_rep is the old name of check_vma: pass only check_vma"
            )
        check_vma = bool(check_rep)
    return ShardMapped(f, mesh, in_specs, out_specs, bool(check_vma), backend, randomness)


class ShardMapped:
    """The callable returned by ``shard_map``; ``.collectives(*args)`` gives its manifest."""

    def __init__(self, f, mesh, in_specs, out_specs, check_vma, backend, randomness):
        self.f, self.mesh = f, mesh
        self.in_specs, self.out_specs = in_specs, out_specs
        self.check_vma, self.backend, self.randomness = check_vma, backend, randomness
        self._cache: dict = {}
        functools.update_wrapper(self, f)

    def __repr__(self) -> str:
        return f"shard_map({getattr(self.f, '__name__', self.f)!r}, mesh={self.mesh!r})"

    # -- argument handling ----------------------------------------------------------------

    def _flat_in(self, args: tuple, *, local: bool = False) -> tuple[list, list, Any, list[str]]:
        leaves, treedef = optree.tree_flatten(args)
        leaves = [_array_in(x) for x in leaves]
        sharded = [isinstance(x, Sharded) for x in leaves]
        if any(sharded):  # values from fsharded.shard stand for their global values
            paths = [_argpath(p) for p in _tree.tree_flatten_with_paths(args)[0]]
            leaves = globals_of(leaves, self.mesh, backend_for(self.mesh, self.backend), paths)
            sharded = [isinstance(x, Sharded) for x in leaves]
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
        if any(sharded):  # real ranks: a shard is taken as it is if it is laid out as asked
            bad = [f"  {p}: sharded as {x.spec!r}, in_specs say {sp!r}"
                   for p, x, sp, sh in zip(paths, leaves, flat_specs, sharded)
                   if sh and dims(x.spec, x.dim()) != dims(sp, x.dim())]
            if bad:
                raise ValueError(
                    "shard_map: arguments sharded with another layout than in_specs:\n"
                    + "\n".join(bad) + "\nShard them with the in_specs' spec, or unshard them "
                    "(fsharded.unshard) and pass the global values"
                )
        checked = [torch.empty(x.global_shape(), dtype=x.dtype, device="meta") if sh else x
                   for x, sh in zip(leaves, sharded)]
        if local:  # shard shapes: only the axes and ranks can be checked
            check_tree_local(checked, flat_specs, paths, self.mesh, "shard_map in_specs")
        else:
            check_tree(checked, flat_specs, paths, self.mesh, "shard_map in_specs")
        self._remember(key, (flat_specs, paths))
        return leaves, flat_specs, treedef, paths

    def _flat_out(self, out: Any) -> tuple[list, list, Any, list[str]]:
        leaves, treedef = optree.tree_flatten(out)
        leaves = [_as_tensor(x) for x in leaves]
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

    @property
    def check_rep(self) -> bool:
        """The old name of ``check_vma``."""
        return self.check_vma

    def __call__(self, *args: Any) -> Any:
        if backend_for(self.mesh, self.backend) == "virtual":
            return _virtual.call(self, args)
        return _distributed.call(self, args)

    def local(self, *args: Any) -> Any:
        """Call with this rank's shards and get this rank's shards back.

        On the distributed backend nothing is sliced or gathered: arguments are the local
        shards laid out by ``in_specs`` (as ``fsharded.shard`` makes them) and outputs are
        left as shards. Step functions keep their state this way. On the virtual mesh the
        whole mesh lives in one process, so this is the same as calling with global values.
        """
        if backend_for(self.mesh, self.backend) == "virtual":
            return _virtual.call(self, args)
        return _distributed.call(self, args, local=True)

    def collectives(self, *args: Any) -> _manifest.Manifest:
        """The collectives one call runs, in order, without running them.

        Runs ``f`` without its data and without communicating (a dry run) and records
        every collective: op, axis, dtype, per-shard shape and bytes each rank sends.
        Collectives in a ``torch.func.grad`` inside ``f`` are listed with phase
        ``backward``. The virtual mesh runs it over meta tensors of the arguments' shapes,
        or, for code meta tensors cannot run, fake ones (see ``fsharded.spmd._schedule``);
        the distributed backend runs it as one rank does, on device 0's shards, with the
        collectives answering locally. A program that reads tensor values on the host
        (``.item()``, ``if t.sum() > 0:``; vmap cannot batch those) is run as device 0
        on copies of its shards' values on CPU: one forward and backward of compute.
        """
        distributed = backend_for(self.mesh, self.backend) == "distributed"

        def attempt(kind: _schedule.Kind) -> list:
            if distributed or kind.tensors == "real":
                with _manifest.recording(dry=True) as entries:
                    _schedule.run_shard(self, args, kind)
                return entries
            with _schedule.stand_ins(kind) as convert, _manifest.recording() as entries:
                _virtual.call(self, convert(args))
            return entries

        _, entries = _schedule.first_run(attempt, what="collectives()")
        return _manifest.Manifest(entries)


def _as_tensor(x: Any) -> Any:
    """A number or numpy value a body returned, as the tensor JAX's array would be."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (bool, int, float, complex)) or type(x).__module__ == "numpy":
        try:
            return torch.as_tensor(x, device=torch.get_default_device())
        except (TypeError, RuntimeError):
            return x  # a numpy object array: refused below as not a tensor
    return x


def _array_in(x: Any) -> Any:
    """A numpy array argument as a tensor (sharing its memory), as JAX takes one as an
    array: split by its spec, batched by vmap. Numbers and numpy scalars stay as they are."""
    if type(x).__module__ == "numpy" and type(x).__name__ == "ndarray":
        try:
            return torch.as_tensor(x, device=torch.get_default_device())
        except (TypeError, RuntimeError):
            return x  # an object or string array: named below as not a tensor
    return x


def _signature(leaves: list) -> tuple:
    # Off the __torch_function__ path: inside a body every .shape would pass through the
    # varying-axes mode (hundreds per step for a training state).
    with torch._C.DisableTorchFunction():
        return tuple(
            (tuple(x.shape), x.dtype, type(x)) if isinstance(x, torch.Tensor) else type(x) for x in leaves
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
