"""Varying manual axes (JAX's *vma*): the set of mesh axes each value in a shard_map body
varies over, computed by rules as the body runs, the same way on both backends.

* Inputs start with the axes their ``in_specs`` name; ``axis_index`` varies over its axes.
* Each collective has its rule beside it (``_prims``): ``psum``/``pmean``/``pmax`` remove
  the axes, ``pvary``, ``all_gather``, ``psum_scatter``, ``all_to_all`` and ``ppermute``
  keep or add them, ``all_gather_invariant`` removes them.
* An in-place write (an in-place op, item assignment, ``out=``) gives its target the
  union, and the tensor the target is a view of too; a view of a tensor widened that way
  carries its base's axes, so a buffer filled row by row with varying values varies.
* Every other op takes the union of its operands' axes. Where an invariant operand that is
  being differentiated meets a varying one, an implicit ``pvary`` is inserted (identity
  forward, ``psum`` backward): the cotangent of a value that is the same on every shard
  is the sum of the shards' cotangents. This is what makes gradients taken inside the body
  JAX's, and what makes fan-out (an invariant output under an out_spec that names the
  axis) transpose to a ``psum``.
* ``torch.autograd.grad`` (so also ``torch.func.grad``/``vjp``) and ``Tensor.grad`` give
  a cotangent the type of its primal. ``_foreach_*`` ops act index by index.
* An autograd Function under torch.func transforms (the virtual mesh) is opaque: its
  outputs get the union of its inputs' types, unless the Function types its own insides
  (``vma_typed = True`` on the class, as the remat ``fsharded.parallel.remat.checkpoint``
  does with ``VmaMode.typing``). In eager autograd (real ranks) the mode sees the ops of
  its forward instead, run without grad: their types come out right, but no implicit
  ``pvary`` is inserted for the Function's inputs, so a Function whose inputs differ in
  their axes pvaries the invariant ones itself (as ``moe``'s per-row experts do).

The types are tracked by a ``TorchFunctionMode`` that ``shard_map`` enters for the body;
each value's axes are kept by object identity. Values whose history the mode did not see
(created inside a ``torch.func`` transform and unwrapped at its exit) are typed by looking
through the functorch wrappers, and on the virtual mesh also by the vmap levels they are
batched at (a value batched at an axis' level certainly varies over it).

Typing by assumption (``VmaMode.assuming``): where every differentiated input of a stretch
of the body varies over every axis of size > 1 (a data-parallel or ZeRO step: the
parameters are marked varying over the batch axes before differentiating), no implicit
``pvary`` can arise in it until a collective makes a differentiated value invariant over
such an axis. The stretch then runs with the mode off torch's stack (no per-op cost):
differentiated values are known to vary over every axis, and a reduction of one, or a
question about a value whose type that does not settle, stops the stretch
(``NeedsTyping``) so that the caller runs it again typed.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

__all__ = ["VmaMode", "NeedsTyping"]


class NeedsTyping(BaseException):
    """A stretch run under ``VmaMode.assuming`` met what the assumption does not settle; run
    it again typed. (A BaseException: a loss function's ``except Exception`` must not
    swallow it; ``VmaMode.assume_failed`` records it besides.)"""

_F = torch._C._functorch
_NONE: frozenset = frozenset()
_AUTOGRAD_GRAD = torch.autograd.grad
_GRAD_GET = torch.Tensor.grad.__get__


class VmaMode(TorchFunctionMode):
    """Tracks the varying axes of every value computed in one shard_map body.

    ``pvary(x, axes)`` inserts an implicit pvary (an autograd node whose backward is a
    psum over ``axes``); ``levels`` maps the virtual mesh's vmap levels to axis names.
    """

    def __init__(self, axis_names: tuple[str, ...],
                 pvary: Callable[[torch.Tensor, tuple[str, ...]], torch.Tensor],
                 levels: dict[int, str] | None = None) -> None:
        super().__init__()
        self.axis_names = axis_names
        self._pvary = pvary
        self.levels = levels or {}
        self._vma: dict[int, tuple[weakref.ref, frozenset]] = {}
        # >0 while an op runs on the mode's behalf (a collective's own implementation,
        # autograd's backward pass): those internals are not typed.
        self.dispatching = 0
        self._carried: list[list[frozenset]] = []
        self.last: frozenset | None = None  # the type of the last collective's result
        # Tensors whose type an in-place write widened (directly or through a view): their
        # views, made before or after the write, share the storage and so the type.
        self._widened: dict[int, weakref.ref] = {}
        # Under ``assuming``: the axes every differentiated value varies over (else None),
        # and whether the assumption met something it does not settle.
        self.assumed: frozenset | None = None
        self.assume_failed = False

    # -- the table ------------------------------------------------------------------------

    def _lookup(self, t: torch.Tensor) -> frozenset | None:
        e = self._vma.get(id(t))
        return e[1] if e is not None and e[0]() is t else None

    def known(self, t: torch.Tensor) -> bool:
        """Whether the table typed ``t`` itself, or its value inside a torch.func wrapper
        (rather than defaulting an unseen value to invariant)."""
        cur = t
        while True:
            if self._lookup(cur) is not None:
                return True
            if not _F.is_functorch_wrapped_tensor(cur):
                return False
            cur = _F.get_unwrapped(cur)

    def _base_type(self, t: torch.Tensor) -> frozenset:
        """The type a view inherits from its base when an in-place write widened that."""
        b = t._base
        if b is None:
            return _NONE
        e = self._widened.get(id(b))
        return (self._lookup(b) or _NONE) if e is not None and e() is b else _NONE

    def widen(self, t: torch.Tensor, axes: frozenset) -> None:
        """``t`` was written in place with values varying over ``axes``: it, and the tensor
        it is a view of (whose other views then see the same), vary over them too."""
        self.set(t, self.get(t) | axes)
        for cur in (t, t._base):
            if cur is not None:
                if cur is not t:
                    self.set(cur, self.get(cur) | axes)
                self._widened[id(cur)] = weakref.ref(cur)

    def get(self, t: torch.Tensor) -> frozenset:
        """The axes ``t`` varies over."""
        if self.assumed is not None and not self.dispatching:
            return self._assumed_type(t)
        if self._widened and t._base is not None:
            inherited = self._base_type(t)
            if inherited:
                return self._get(t) | inherited
        return self._get(t)

    def _get(self, t: torch.Tensor) -> frozenset:
        found = self._lookup(t)
        if found is not None:
            return found
        if not _F.is_functorch_wrapped_tensor(t):
            return _NONE
        # Look through torch.func's wrappers: a wrapper has its inner value's type, plus
        # the virtual mesh axis whose vmap level it is batched at.
        axes: set[str] = set()
        cur = t
        while _F.is_functorch_wrapped_tensor(cur):
            if _F.is_batchedtensor(cur):
                name = self.levels.get(_F.maybe_get_level(cur))
                if name is not None:
                    axes.add(name)
            cur = _F.get_unwrapped(cur)
            found = self._lookup(cur)
            if found is not None:
                return found  # typed by the rules: the batching above it adds nothing
        return frozenset(axes)

    def _assumed_type(self, t: torch.Tensor) -> frozenset:
        if self.known(t):
            return self._get(t)
        if t.requires_grad:  # differentiated: from inputs that vary over every axis
            return self.assumed
        self.stop_assuming()

    def stop_assuming(self) -> None:
        """The assumption does not settle what the caller asks: stop the stretch."""
        self.assume_failed = True
        raise NeedsTyping

    @contextlib.contextmanager
    def assuming(self, axes: frozenset) -> Iterator[None]:
        """Run the block untyped, every differentiated value taken to vary over ``axes``
        (every mesh axis of size > 1): the caller has checked that every differentiated
        input does. The mode leaves torch's stack for the block (modes above it stay); a
        collective that would make a differentiated value invariant over one of ``axes``,
        or a question about the type of a value the assumption does not cover, raises
        ``NeedsTyping``."""
        stack = torch.overrides._get_current_function_mode_stack()
        if not any(m is self for m in stack):
            raise RuntimeError("VmaMode.assuming: the mode is not entered")
        above = []
        while (m := torch.overrides._pop_mode()) is not self:
            above.append(m)
        for m in reversed(above):
            torch.overrides._push_mode(m)
        self.assumed, self.assume_failed = frozenset(axes), False
        try:
            yield
        finally:
            self.assumed = None
            back = [torch.overrides._pop_mode() for _ in above]
            torch.overrides._push_mode(self)
            for m in reversed(back):
                torch.overrides._push_mode(m)

    def set(self, t: torch.Tensor, axes: frozenset) -> None:
        """Record that ``t`` varies over ``axes``. The value inside a grad-tracking or a
        user's vmap wrapper (what the transform hands back when it returns) gets the same
        type."""
        axes = frozenset(axes)
        cur = t
        while True:
            self._vma[id(cur)] = (weakref.ref(cur), axes)
            if not _F.is_functorch_wrapped_tensor(cur):
                return
            if _F.is_batchedtensor(cur) and _F.maybe_get_level(cur) in self.levels:
                return  # a mesh axis' own level: the inner value is outside the body
            cur = _F.get_unwrapped(cur)

    def ordered(self, axes: frozenset | set) -> tuple[str, ...]:
        return tuple(a for a in self.axis_names if a in axes)

    def pvary(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """``x`` marked varying over ``axes`` as well: an autograd node (psum backward)
        when ``x`` is being differentiated, a new typed view otherwise."""
        if not axes:
            return x
        self.dispatching += 1
        try:
            differentiated = x.requires_grad and torch.is_grad_enabled()
            with torch._C.DisableTorchFunction():
                y = self._pvary(x, axes) if differentiated else x.view_as(x)
        finally:
            self.dispatching -= 1
        self.set(y, self.get(x) | frozenset(axes))
        return y

    @contextlib.contextmanager
    def paused(self) -> Iterator[VmaMode]:
        """Ops run inside are not typed (collectives still communicate over every axis
        they name: nothing is shortcut). For a stretch of per-leaf arithmetic whose types
        the caller knows (a training step's optimizer update on shards laid out by their
        specs), where typing every op would cost more than the math."""
        self.dispatching += 1
        try:
            with torch._C.DisableTorchFunction():  # off the __torch_function__ path too
                yield self
        finally:
            self.dispatching -= 1

    @contextlib.contextmanager
    def typing(self) -> Iterator[VmaMode]:
        """Type the ops run inside (from within an op the mode dispatches, where torch
        has set the mode aside): how a remat'ed function is typed in its forward and in
        its recomputation, so both insert the same implicit pvarys."""
        saved, self.dispatching = self.dispatching, 0
        try:
            with self:
                yield self
        finally:
            self.dispatching = saved

    # -- the rule for every other op ----------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.dispatching:
            return func(*args, **kwargs)
        try:
            kind = _kind(func)
        except TypeError:  # an unhashable callable: classify it each time
            kind = _kind.__wrapped__(func)
        if kind is not _PLAIN:
            if kind is _ATTR:  # x.shape, x.dtype, ...: a tensor only for x.T, x.data, ...
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
                    v = self.get(args[0])
                    if v:
                        self.set(out, v)
                return out
            if kind is _GRAD:
                return self._autograd_grad(args, kwargs)
            if kind is _FOREACH:
                return self._foreach(func, args, kwargs)
            if kind is _CUSTOM and getattr(args[0], "vma_typed", False):
                return self._self_typed(func, args, kwargs)
        # The hot path (every op of the body): the operands' types, inlined.
        table, wrapped, widened = self._vma, _F.is_functorch_wrapped_tensor, self._widened
        typed = []
        union = _NONE
        for a in (args if not kwargs else (*args, *kwargs.values())):
            if isinstance(a, torch.Tensor):
                items = (a,)
            elif isinstance(a, (list, tuple)):
                items = a
            else:
                continue
            for t in items:
                if not isinstance(t, torch.Tensor):
                    continue
                e = table.get(id(t))
                if e is not None and e[0]() is t:
                    v = e[1]
                else:
                    v = self.get(t) if wrapped(t) else _NONE
                if widened and t._base is not None:
                    v = v | self._base_type(t)
                typed.append((t, v))
                if v:
                    union = union | v
        if union and torch.is_grad_enabled():
            args, kwargs = self._insert_pvary(func, args, kwargs, typed, union)
        self.dispatching += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.dispatching -= 1
        if union:
            if kind is _GETGRAD:  # ``x.grad``: a cotangent has its primal's type
                if isinstance(out, torch.Tensor):
                    self.set(out, typed[0][1])
                return out
            if kind is _MUTATES and args and isinstance(args[0], torch.Tensor):
                self.widen(args[0], union)
            for t in _out_tensors(kwargs.get("out")):  # ``out=``: written in place
                self.widen(t, union)
            if isinstance(out, torch.Tensor):
                self.set(out, union)
            else:
                for t in _out_tensors(out):
                    self.set(t, union)
        return out

    def _differentiated_here(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is differentiated in a way the implicit pvary matters for. On the
        virtual mesh only by a torch.func transform inside the body (its wrapper sits above
        the mesh's vmap levels): a gradient taken outside shard_map already sums over the
        shards through vmap's own broadcasting. On real ranks, by any autograd."""
        if not t.requires_grad:
            return False
        if not self.levels:
            return True
        return (_F.is_functorch_wrapped_tensor(t) and not _F.is_batchedtensor(t)
                and _F.maybe_get_level(t) > max(self.levels))

    def _insert_pvary(self, func, args, kwargs, typed, union):
        missing = [(t, union - v) for t, v in typed if v != union and self._differentiated_here(t)]
        if _mutates(func) and args and isinstance(args[0], torch.Tensor):
            missing = [(t, m) for t, m in missing if t is not args[0]]
        if not missing:
            return args, kwargs
        swap = {id(t): self.pvary(t, self.ordered(m)) for t, m in missing}
        args, kwargs = optree.tree_map(
            lambda x: swap.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs),
            none_is_leaf=True)
        return args, kwargs

    def _self_typed(self, func, args, kwargs):
        """An autograd Function that types its own insides, under a torch.func transform
        (which hands back new wrappers of its outputs): the wrappers get the types the
        insides computed, passed up through ``carry``."""
        self._carried.append([])
        self.dispatching += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.dispatching -= 1
            carried = self._carried.pop()
        for t, v in zip(_out_tensors(out), carried):
            self.set(t, v)
        return out

    def carry(self, out: Any) -> None:
        """Called by a self-typed Function with what its forward returns."""
        if self._carried:
            self._carried[-1].extend(self.get(t) for t in _out_tensors(out))

    def _foreach(self, func, args, kwargs):
        """Multi-tensor ops act list index by list index: element i of the result has the
        union of the i-th elements' types (and of any single tensor operand)."""
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))
                 and a and isinstance(a[0], torch.Tensor)]
        shared = _NONE
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                shared = shared | self.get(a)
        n = len(lists[0]) if lists else 0
        per = [frozenset().union(shared, *(self.get(lst[i]) for lst in lists)) for i in range(n)]
        self.dispatching += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.dispatching -= 1
        targets = out if isinstance(out, (list, tuple)) else lists[0] if lists else []
        if func.__name__.endswith("_") and lists:
            targets = lists[0]  # in place: the first list is the result
        for t, v in zip(targets, per):
            if isinstance(t, torch.Tensor) and v:
                self.set(t, v)
        return out

    def _autograd_grad(self, args, kwargs):
        inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
        self.dispatching += 1
        try:
            out = _AUTOGRAD_GRAD(*args, **kwargs)
        finally:
            self.dispatching -= 1
        ins = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        for x, g in zip(ins, out):
            # A cotangent has its primal's type; one at a node's output (a GradientEdge)
            # has no tensor to take it from and is typed by the ops that read it.
            if isinstance(g, torch.Tensor) and isinstance(x, torch.Tensor):
                self.set(g, self.get(x))
        return out


_PLAIN, _GRAD, _FOREACH, _CUSTOM, _MUTATES, _GETGRAD, _ATTR = (
    "plain", "grad", "foreach", "custom", "mutates", "getgrad", "attr")


@functools.lru_cache(maxsize=4096)
def _kind(func: Any) -> str:
    """Which rule a function follows (looked up once per function)."""
    if func is _AUTOGRAD_GRAD:
        return _GRAD
    if func is _GRAD_GET:
        return _GETGRAD
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return _ATTR
    if name.startswith("_foreach_"):
        return _FOREACH
    if name == "custom_function_call":
        return _CUSTOM
    return _MUTATES if _mutates(func) else _PLAIN


def _mutates(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor operands, one level into lists and tuples (``torch.cat([a, b])``)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _out_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [x for x in out if isinstance(x, torch.Tensor)]
    return []


def axis_set(spec: Any) -> frozenset:
    """The axes a spec names, as the type of a value laid out by it (kept per spec)."""
    try:
        return _AXIS_SETS[spec]
    except KeyError:
        return _AXIS_SETS.setdefault(spec, frozenset(spec.axes))


_AXIS_SETS: dict = {}


def output_types(mode: VmaMode, leaves: list, specs: list, paths: list[str], *,
                 check: bool) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """For each output: ``(fan_out, undeclared)`` — the axes its out_spec names that it is
    invariant over (they get an implicit pvary, so the fan-out transposes to a psum), and
    the axes it varies over that its out_spec leaves out. With ``check`` (JAX's
    ``check_vma``) any of the latter is a ValueError listing every such output."""
    out, bad = [], []
    for path, y, s in zip(paths, leaves, specs):
        vma = mode.get(y)
        named = axis_set(s)
        if vma == named:  # typed as declared (every leaf of a step's state): nothing to add
            out.append(((), ()))
            continue
        fan = mode.ordered(named - vma)
        undeclared = mode.ordered(vma - named)
        if undeclared:
            bad.append(
                f"  {path}: varies over {list(undeclared)} (its varying axes: "
                f"{list(mode.ordered(vma))}) but out_specs {s!r} leave "
                f"{'it' if len(undeclared) == 1 else 'them'} out"
            )
        out.append((fan, undeclared))
    if check and bad:
        raise ValueError(
            "shard_map: out_specs must name every mesh axis an output varies over "
            "(check_vma=True, as in JAX):\n" + "\n".join(bad) + "\nAdd the axes to the "
            "out_specs, reduce over them first (psum / pmean / pmax, or all_gather_invariant), "
            "or pass check_vma=False to take shard 0's value along them unchecked."
        )
    return out


def run_body(mode: VmaMode, sm: Any, leaves: list, specs: list, treedef: Any) -> tuple:
    """Call the shard_map'ed function on this shard's arguments with their types set from
    ``in_specs``; its outputs with their specs and ``output_types``."""
    for x, s in zip(leaves, specs):
        if isinstance(x, torch.Tensor):
            mode.set(x, axis_set(s))
    out = sm.f(*optree.tree_unflatten(treedef, list(leaves)))
    o_leaves, o_specs, o_def, o_paths = sm._flat_out(out)
    return o_leaves, o_specs, o_def, output_types(mode, o_leaves, o_specs, o_paths, check=sm.check_vma)
