"""JAX's collective signatures, so code written for ``jax.lax`` ports by changing the import.

>>> from fsharded import lax           # instead of: from jax import lax
>>> y = lax.all_gather(x, "i", axis=0, tiled=True)

The same primitives as ``fsharded.psum`` and friends (same transposes and varying-axes
rules), with JAX's argument names and defaults: ``all_gather``, ``psum_scatter`` and
``all_to_all`` are untiled unless ``tiled=True``. ``axis_index_groups`` is not supported
(a ``NotImplementedError``); map over a sub-mesh axis instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsharded.spmd import collectives as _c

__all__ = ["psum", "pmean", "pmax", "pmin", "pvary", "pcast", "all_gather", "all_gather_invariant",
           "psum_scatter", "all_to_all", "ppermute", "axis_index", "axis_size"]


def _no_groups(op: str, groups: Any) -> None:
    if groups is not None:
        raise NotImplementedError(
            f"fsharded.lax.{op}: axis_index_groups is not supported; give the groups their own "
            f"mesh axis (e.g. Mesh({{'outer': k, 'inner': n // k}})) and reduce over it"
        )


def psum(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """Sum over the mesh axis (or tuple of axes) ``axis_name``: JAX's ``lax.psum``; the result
    is invariant over it."""
    _no_groups("psum", axis_index_groups)
    return _c.psum(x, axis_name)


def pmean(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """Mean over ``axis_name``: JAX's ``lax.pmean``."""
    _no_groups("pmean", axis_index_groups)
    return _c.pmean(x, axis_name)


def pmax(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """Maximum over ``axis_name``: JAX's ``lax.pmax``."""
    _no_groups("pmax", axis_index_groups)
    return _c.pmax(x, axis_name)


def pmin(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """Minimum over ``axis_name``: JAX's ``lax.pmin``."""
    _no_groups("pmin", axis_index_groups)
    return _c.pmin(x, axis_name)


def pvary(x: Any, axis_name: Any) -> Any:
    """Mark ``x`` as varying over ``axis_name`` without moving data: JAX's ``lax.pvary`` (its
    transpose is a psum)."""
    return _c.pvary(x, axis_name)


def pcast(x: Any, axis_name: Any, *, to: str) -> Any:
    """``to="varying"``: ``pvary``. JAX's other targets (``"reduced"``, ``"unreduced"``) are
    not types fsharded has (a ``NotImplementedError``); any other value is a ``ValueError``
    as in JAX."""
    if to in ("reduced", "unreduced"):
        raise NotImplementedError(
            f"fsharded.lax.pcast: to={to!r}: fsharded types values as varying or invariant over an "
            f"axis and has no {to!r} type; only to='varying' is supported")
    if to != "varying":
        raise ValueError(f"fsharded.lax.pcast: to={to!r}; allowed values are "
                         f"['unreduced', 'reduced', 'varying'] (as in JAX)")
    return _c.pvary(x, axis_name)


def all_gather(x: Any, axis_name: Any, *, axis_index_groups: Any = None, axis: int = 0,
               tiled: bool = False, to: str = "varying") -> Any:
    """JAX's ``all_gather``: untiled by default; ``to="varying"`` (default) or
    ``"invarying"`` (as ``all_gather_invariant``); ``"reduced"`` is not supported."""
    _no_groups("all_gather", axis_index_groups)
    return _c.all_gather(x, axis_name, dim=axis, tiled=tiled, to=to)


def all_gather_invariant(x: Any, axis_name: Any, *, axis_index_groups: Any = None, axis: int = 0,
                         tiled: bool = False) -> Any:
    """Gather every shard's ``x`` along ``axis`` into a value invariant over ``axis_name``."""
    _no_groups("all_gather_invariant", axis_index_groups)
    return _c.all_gather_invariant(x, axis_name, dim=axis, tiled=tiled)


def psum_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0,
                 axis_index_groups: Any = None, tiled: bool = False) -> Any:
    """Sum over ``axis_name`` and keep this shard's piece along ``scatter_dimension``: JAX's
    ``lax.psum_scatter`` (untiled by default)."""
    _no_groups("psum_scatter", axis_index_groups)
    return _c.psum_scatter(x, axis_name, dim=scatter_dimension, tiled=tiled)


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               axis_index_groups: Any = None, tiled: bool = False) -> Any:
    """Split ``split_axis`` into pieces sent one per shard and concatenate those received along
    ``concat_axis``: JAX's ``lax.all_to_all``."""
    _no_groups("all_to_all", axis_index_groups)
    return _c.all_to_all(x, axis_name, split_dim=split_axis, concat_dim=concat_axis, tiled=tiled)


def ppermute(x: Any, axis_name: Any, perm: Sequence[tuple[int, int]]) -> Any:
    """Send ``x`` along the ``(source, destination)`` pairs of ``perm`` over ``axis_name``; a
    shard no pair sends to gets zeros, as in JAX."""
    return _c.ppermute(x, axis_name, perm)


def axis_index(axis_name: Any) -> Any:
    """This shard's index along ``axis_name`` (a 0-d int tensor)."""
    return _c.axis_index(axis_name)


def axis_size(axis_name: Any) -> int:
    """The number of shards along ``axis_name``."""
    return _c.axis_size(axis_name)
