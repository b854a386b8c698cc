"""The block contract: how a model tells a training step where its repeated blocks run.

A model runs each of its repeated blocks (transformer layers) through ``run_block``::

    for p in params["blocks"]:
        x = fs.parallel.run_block(block, p, x)

and the step is told where the block list lives in the parameter tree
(``train_step(..., blocks="blocks")``, or the path ``fs.nn.functional`` found, e.g.
``"transformer.h"``). Outside a step, or in a step that does not need it, ``run_block``
is ``block(p, x)``. Inside a ZeRO-3 step the block's parameters arrive sharded and are
gathered here, one block at a time (and gathered again in backward); remat and pipeline
stages cut at the same place. The first positional argument after the parameters is the
block's input activation.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from fsharded import random as R

__all__ = ["run_block", "handling", "active", "Keyed"]

_HANDLER: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "fsharded_block_handler", default=None)


def run_block(block: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Any:
    """``block(params, *args, **kwargs)``, through the handler of the step running it.

    Inside an ``fs.random.scope`` the block gets a key of its own (forked from the scope)
    and every run of it draws from that key: a handler that runs the block again in
    backward (ZeRO-3's remat) draws the same dropout masks, and the draws are the same
    whichever handler runs it."""
    key = R.fork(lazy=True)  # derived only if the block draws (or a remat needs it)
    if key is not None:
        block = Keyed(block, key)
    handler = _HANDLER.get()
    if handler is None:
        return block(params, *args, **kwargs)
    return handler(block, params, *args, **kwargs)


@contextlib.contextmanager
def handling(handler: Callable[..., Any] | None) -> Iterator[None]:
    """Route every ``run_block`` call in the ``with`` body through ``handler(block, params,
    *args, **kwargs)`` (which must call ``block`` once on the block's full parameters).
    The handler is not active inside itself: nested blocks run plainly."""
    token = _HANDLER.set(handler)
    try:
        yield
    finally:
        _HANDLER.reset(token)


class Keyed:
    """``block`` run under ``scope(key)`` each time it is called (a handler that recomputes
    the block inside an autograd Function passes ``key()`` in as an input instead).
    ``key``: a function giving the block's key, the same each call."""

    def __init__(self, block: Callable[..., Any], key: Callable[[], Any]) -> None:
        self.block, self.key = block, key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mode = R.innermost()
        # Within the enclosing scope's mode when there is one (one mode per op, not two);
        # a fresh scope where modes were set aside (inside an autograd Function).
        with mode.rekeyed(self.key) if mode is not None else R.scope(self.key):
            return self.block(*args, **kwargs)


def active() -> bool:
    """Whether a handler routes blocks now (the step's per-block ZeRO-3, a remat policy)."""
    return _HANDLER.get() is not None


def current() -> Callable[..., Any] | None:
    """The handler that routes blocks now (None: they run plainly): a handler installed
    inside another hands its blocks on to it (``handler(block, params, ...)``) to compose."""
    return _HANDLER.get()
