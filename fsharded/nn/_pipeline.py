"""An ``nn.Module`` cut into pipeline stages at its block list (``fs.nn.functional``).

The module's forward is not rewritten: every stage runs it whole, on its own parameters
(the others stand in as zero-stride placeholders of their shapes), with a block handler
that skips the blocks before the stage's run, hands the first of them the activation the
previous stage sent, and stops the forward after the last (the stage's output). The last
stage runs to the loss. What each end reads outside the blocks (embeddings, final norm,
head; a tied head on both) is found by one forward on meta tensors.

>>> fm = fs.nn.functional(transformers.LlamaForCausalLM(config))       # doctest: +SKIP
>>> loss = lambda fm, p, b: fm.apply(p, input_ids=b["input_ids"], labels=b["labels"]).loss
>>> stages = fs.nn.pipeline_stages(fm, 2, loss, batch)                 # doctest: +SKIP
>>> step = fs.train_step(fs.parallel.pipeline.pipelined(stages, microbatches=4), opt,
...                      mesh=fs.Mesh({"pipe": 2}))                      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import optree
import torch
from torch.overrides import TorchFunctionMode

from fsharded import _tree
from fsharded.nn._functional import FunctionalModule
from fsharded.parallel import blocks as _blocks
from fsharded.parallel.pipeline import Stages, cut

__all__ = ["pipeline_stages", "ModuleStages"]


class _Cut(BaseException):
    """The stage's output, raised past the rest of the forward (a BaseException: a model's
    ``except Exception`` must not swallow it)."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.x = x


@dataclasses.dataclass(frozen=True)
class ModuleStages(Stages):
    """``Stages`` of a ``FunctionalModule``: ``loss(fm, params, batch)`` is the module's
    loss; ``forward`` runs it per stage (see the module's docstring)."""

    fm: Any = None
    loss: Callable[..., torch.Tensor] | None = None
    replays: ClassVar[bool] = True  # every stage runs the module's forward from its start

    def forward(self, s: int, params: dict, x: Any, batch: Any, state: Any = None) -> torch.Tensor:
        if state is not None:
            raise NotImplementedError("pipeline: a model state (train_step's update_model_state) with the stages "
                                      "of an nn.Module: not supported; cut the model into Stages of your own "
                                      "(Stages(..., block_state=, stats=))")
        full = self._assemble(params, s)
        first, stop = self.ranges[s].start, self.ranges[s].stop
        last = s == self.n - 1
        seen = [0]
        outer = _blocks.current()  # the step's own (a remat policy, ZeRO-3's gathers): it runs this stage's blocks

        def handler(block: Callable, p: Any, h: Any, *args: Any, **kwargs: Any) -> Any:
            i = seen[0]
            seen[0] += 1
            if i < first:
                return h  # an earlier stage's block
            if i == first and s > 0:
                h = x  # what the previous stage sent
            out = outer(block, p, h, *args, **kwargs) if outer is not None else block(p, h, *args, **kwargs)
            if i == stop - 1 and not last:
                raise _Cut(out)
            return out

        with _blocks.handling(handler):
            try:
                return self.loss(self.fm, full, batch)
            except _Cut as c:
                return c.x

    def _assemble(self, part: dict, s: int) -> Any:
        """The module's whole tree from stage ``s``'s part, the rest zero-stride placeholders."""
        held: dict[str, torch.Tensor] = {}
        for i, b in zip(self.ranges[s], part[self.blocks]):
            for p, t in zip(*_tree.tree_flatten_with_paths(b)[:2]):
                held[f"{self.blocks}.{i}.{p}"] = t
        for k in self.keys(s):
            held[k] = part[k]
        paths, leaves, tdef = _tree.tree_flatten_with_paths(self.fm.params)
        some = next(iter(held.values()))
        return optree.tree_unflatten(tdef, [
            held[p] if p in held else torch.zeros((), dtype=x.dtype, device=some.device).expand(x.shape)
            for p, x in zip(paths, leaves)])


class _Uses(TorchFunctionMode):
    """Which of ``leaves`` the ops read, before the first block and after the last."""

    def __init__(self, leaves: dict[int, str]) -> None:
        super().__init__()
        self.leaves, self.phase = leaves, "first"
        self.read: dict[str, set[str]] = {"first": set(), "last": set()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Reading an attribute (``w.dtype``, ``w.device``: how a model finds its dtype) is
        # not a use of the values.
        if self.phase in self.read and getattr(func, "__name__", "") != "__get__":
            for t in optree.tree_leaves((args, kwargs or {})):
                if isinstance(t, torch.Tensor) and id(t) in self.leaves:
                    self.read[self.phase].add(self.leaves[id(t)])
        return func(*args, **(kwargs or {}))


def _ends(fm: FunctionalModule, loss: Callable, batch: Any) -> tuple[list[str], list[str]]:
    """The non-block leaves the forward reads before its first block and after its last,
    from one forward on meta tensors."""
    paths, leaves, tdef = _tree.tree_flatten_with_paths(fm.params)
    meta = [torch.empty(x.shape, dtype=x.dtype, device="meta") for x in leaves]
    n = len(_tree.get_path(fm.params, fm.blocks))
    uses = _Uses({id(t): p for p, t in zip(paths, meta) if not p.startswith(fm.blocks + ".")})
    seen = [0]

    def handler(block: Callable, p: Any, h: Any, *args: Any, **kwargs: Any) -> Any:
        uses.phase = "blocks"
        out = block(p, h, *args, **kwargs)
        seen[0] += 1
        if seen[0] == n:
            uses.phase = "last"
        return out

    mb = optree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                         if isinstance(t, torch.Tensor) else t, batch)
    with _blocks.handling(handler), uses:
        loss(fm, optree.tree_unflatten(tdef, meta), mb)
    if seen[0] != n:
        raise ValueError(f"fs.nn.pipeline_stages: the forward ran {seen[0]} of the {n} blocks at "
                         f"{fm.blocks!r}; a pipeline cuts a forward that runs each block once, in order")
    first = [p for p in paths if p in uses.read["first"]]
    last = [p for p in paths if p in uses.read["last"]]
    return first, last


def pipeline_stages(fm: FunctionalModule, stages: int, loss: Callable[[FunctionalModule, Any, Any], torch.Tensor],
                    batch: Any, *, boundaries: Sequence[int] | None = None) -> ModuleStages:
    """``fm``'s module cut into ``stages`` pipeline stages at its block list (``fm.blocks``),
    balanced by parameter count or cut at ``boundaries``. ``loss(fm, params, batch)``: the
    module's loss on a batch (e.g. ``fm.apply(p, input_ids=..., labels=...).loss``);
    ``batch``: an example micro-batch (its shapes only are used, on meta tensors), from
    which one forward finds what the first and the last stage read besides their blocks."""
    if not isinstance(fm, FunctionalModule):
        raise TypeError(f"fs.nn.pipeline_stages: expected fs.nn.functional(module), got {type(fm).__name__}")
    if fm.blocks is None:
        raise ValueError("fs.nn.pipeline_stages: the module has no block list (fs.nn.functional found none); "
                         "pass fs.nn.functional(module, blocks='<path of its nn.ModuleList of blocks>')")
    first, last = _ends(fm, loss, batch)
    paths, leaves, _ = _tree.tree_flatten_with_paths(fm.params)
    size = dict(zip(paths, (x.numel() for x in leaves)))
    outside = [p for p in paths if not p.startswith(fm.blocks + ".")]
    last += [p for p in outside if p not in first and p not in last]  # read by neither: the last holds them
    blocks = _tree.get_path(fm.params, fm.blocks)
    ranges = cut([sum(x.numel() for x in optree.tree_leaves(b)) for b in blocks], stages, boundaries=boundaries,
                 first=sum(size[p] for p in first), last=sum(size[p] for p in last))
    return ModuleStages(None, None, None, tuple(first), tuple(last), ranges, fm.blocks, fm=fm, loss=loss)
