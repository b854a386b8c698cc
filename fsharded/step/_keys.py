"""The step's key scope around the loss, entered only while the loss may draw.

Random ops in the loss draw from the step's key (``fs.random.scope``). The scope is a
``TorchFunctionMode``: while entered, every op of the loss passes through it (about 2 µs
each, ~1.3 ms per step of the bundled GPT whether or not anything draws). ``Keys`` runs
the first step of a plan scoped and notes whether the loss drew: it derived the key, or
touched one of torch's global generators (an op the scope does not see). A loss that did
neither runs unscoped from then on, watched: if an unscoped run touches a global
generator, the generators are put back, the run is redone scoped (the same keys as if it
had been scoped from the start) and the plan stays scoped.

Redoing a run is safe where nothing else took part in it: one process, the virtual mesh
included, where vmap refuses an unscoped draw (``watch``). On real ranks (``ranks``) every
rank decides alike: after each run the ranks agree whether any of them drew (a word each,
exchanged as ``train_step``'s call check exchanges its words: not a collective of the
step's) (the first, scoped, run: whether any derived the key or drew), and if one did
every rank redoes the run scoped, its collectives again in the same order on all of them.
A dry run (the schedule check's) runs scoped and decides nothing.

>>> keys = Keys(watch=True)
>>> grads = keys.run(lambda: fs.random.key(0), lambda: loss_and_grads())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsharded import random as R
from fsharded.spmd import _manifest

__all__ = ["Keys"]


def _generators() -> list[torch.Tensor]:
    """The states of torch's global generators a loss could draw from: the CPU one and,
    once CUDA is in use, each device's."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [g.get_state() for g in torch.cuda.default_generators]
    return states


def _restore(states: list[torch.Tensor]) -> None:
    torch.default_generator.set_state(states[0])
    for g, s in zip(torch.cuda.default_generators if len(states) > 1 else (), states[1:]):
        g.set_state(s)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class Keys:
    """``run(key, fn)``: ``fn()`` under ``fs.random.scope(key)`` while the loss may draw
    (``key``: a function giving the step's key, called at the first draw). ``watch``:
    whether a run may go unscoped once the first one drew nothing (it can be redone)."""

    ranks = None  # real ranks deciding together: ``ranks(drew) -> whether any rank drew``

    def __init__(self, watch: bool, ranks: Callable[[bool], bool] | None = None) -> None:
        self.watch, self.ranks = watch, ranks
        self.draws: bool | None = None if watch else True  # None: not known yet

    def _any(self, drew: bool) -> bool:
        """Whether any rank drew (``drew`` here): the same answer on every rank."""
        return self.ranks(drew) if self.ranks is not None else drew

    def run(self, key: Callable[[], torch.Tensor], fn: Callable[[], Any]) -> Any:
        if self.ranks is not None and _manifest.dry():  # a dry run of a rank's step: scoped, deciding nothing
            with R.scope(key):
                return fn()
        if self.draws is False:
            before, at = _generators(), _manifest.mark()
            try:
                out = fn()
            except RuntimeError as e:  # under the virtual mesh's vmap a draw is refused
                if "randomness error mode" not in str(e):
                    raise
                out = None
            else:
                if not self._any(not _same(before, _generators())):
                    return out
            # It drew (from a global generator): undo that, and redo it under the key.
            del out
            _restore(before)
            _manifest.rewind(at)
            self.draws = True
        if self.draws:
            with R.scope(key):
                return fn()
        derived: list[bool] = []

        def noted() -> torch.Tensor:
            derived.append(True)
            return key()

        before = _generators()
        with R.scope(noted):
            out = fn()
        self.draws = self._any(bool(derived) or not _same(before, _generators()))
        return out
