"""Peer-side pieces of ``fsharded bench zero``: the functional GPT as an ``nn.Module``
(for DeepSpeed and FSDP2), bytes sent counted at ``torch.distributed``, and the floor (a
step with no bookkeeping, the bound an engine can only add to)."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.nn as nn

# -- the same model as an nn.Module ---------------------------------------------------------


class _Leaves(nn.Module):
    """The tensor leaves of a parameter subtree as this module's own parameters
    (``recurse=False``), so ZeRO-3's and FSDP2's hooks find them on the module whose
    forward reads them. ``tree()`` rebuilds the subtree from the current attributes (FSDP2
    swaps in unsharded tensors during forward)."""

    def __init__(self, tree: Any):
        super().__init__()
        from fsharded import _tree

        paths, leaves, treedef = _tree.tree_flatten_with_paths(tree)
        self._treedef = treedef
        self._names = [p.replace(".", "__") for p in paths]
        for name, x in zip(self._names, leaves):
            self.register_parameter(name, nn.Parameter(x.detach().clone()))

    def tree(self) -> Any:
        return optree.tree_unflatten(self._treedef, [getattr(self, n) for n in self._names])

    @torch.no_grad()
    def load(self, tree: Any) -> None:
        from fsharded import _tree

        _, leaves, _ = _tree.tree_flatten_with_paths(tree)
        for name, x in zip(self._names, leaves):
            getattr(self, name).copy_(x)


class _Block(_Leaves):
    def forward(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        from fsharded.models import gpt

        return gpt.block(self.tree(), x, **kw)


class FunctionalGPT(_Leaves):
    """``gpt.loss`` as an ``nn.Module``: the root holds the embeddings and final norm, each
    block is a submodule, and ``forward(tokens)`` is ``gpt.loss(params, {"tokens":
    tokens})`` with every block run through its module (``block_fn``)."""

    def __init__(self, params: dict):
        super().__init__({k: v for k, v in params.items() if k != "blocks"})
        self.blocks = nn.ModuleList(_Block(b) for b in params["blocks"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from fsharded.models import gpt

        p = self.tree()
        p["blocks"] = list(self.blocks)
        return gpt.loss(p, {"tokens": tokens}, block_fn=lambda block, mod, x, **kw: mod(x, **kw))

    def load_functional(self, params: dict) -> None:
        self.load({k: v for k, v in params.items() if k != "blocks"})
        for mod, b in zip(self.blocks, params["blocks"]):
            mod.load(b)


def module_step(model: nn.Module, opt: torch.optim.Optimizer, clip: float, tokens: torch.Tensor) -> torch.Tensor:
    """One step of the eager loop on a module (FSDP2's): forward, backward, clipping and
    the optimizer; the loss, detached."""
    loss = model(tokens)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# -- bytes sent, counted at torch.distributed ------------------------------------------------


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _ar(b: int, n: int) -> int:
    return 2 * (n - 1) * b // n


def _ag(b: int, n: int) -> int:
    return (n - 1) * b


def _part(b: int, n: int) -> int:
    return (n - 1) * b // n


# op -> (argument holding what this rank contributes, bytes one rank sends for it). The
# ring formulas of fsharded/spmd/_prims.py; rooted ops (broadcast, reduce, gather, scatter)
# are charged their per-rank average, (n - 1)/n of the tensor.
_COUNTED: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "all_reduce": ("tensor", _ar),
    "all_reduce_coalesced": ("tensors", _ar),
    "all_gather": ("tensor", _ag),
    "all_gather_into_tensor": ("input_tensor", _ag),
    "_all_gather_base": ("input_tensor", _ag),
    "all_gather_single": ("input_tensor", _ag),
    "all_gather_coalesced": ("input_tensor_list", _ag),
    "reduce_scatter": ("input_list", _part),
    "reduce_scatter_tensor": ("input", _part),
    "_reduce_scatter_base": ("input", _part),
    "reduce_scatter_single": ("input", _part),
    "all_to_all_single": ("input", _part),
    "all_to_all": ("input_tensor_list", _part),
    "broadcast": ("tensor", _part),
    "reduce": ("tensor", _part),
    "gather": ("tensor", _part),
    "scatter": ("tensor", _part),
    "send": ("tensor", lambda b, n: b),
    "isend": ("tensor", lambda b, n: b),
    "recv": ("tensor", lambda b, n: 0),
    "irecv": ("tensor", lambda b, n: 0),
    "barrier": ("group", lambda b, n: 0),
    "broadcast_object_list": ("object_list", lambda b, n: 0),
    "all_gather_object": ("obj", lambda b, n: 0),
}


class ByteCounter:
    """Wraps ``torch.distributed``'s collectives (in ``torch.distributed`` and in
    ``distributed_c10d``) so that, while ``counting()`` is open, every outermost call is
    charged the bytes this rank sends. Installed before DeepSpeed is imported (its backend
    keeps references to the functions). Pass-through otherwise."""

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.active = False
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._depth = threading.local()
        for name, (arg, formula) in _COUNTED.items():
            orig = getattr(c10d, name, None)
            if orig is None or getattr(orig, "_fsharded_counted", False):
                continue
            wrapped = self._wrap(name, orig, arg, formula)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is orig:
                    setattr(mod, name, wrapped)
        from fsharded.comm import _shm

        _shm.set_observer(self._note)  # fsharded's same-host shared-memory collectives

    def _note(self, name: str, x: torch.Tensor, n: int) -> None:
        if self.active and getattr(self._depth, "n", 0) == 0 and n > 1:
            b = _COUNTED[name][1](_nbytes(x), n)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + b

    def _wrap(self, name: str, orig: Callable, arg: str, formula: Callable[[int, int], int]):
        import torch.distributed as dist

        sig = inspect.signature(orig)
        counter = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(counter._depth, "n", 0)
            if counter.active and depth == 0:
                bound = sig.bind(*args, **kwargs)
                n = dist.get_world_size(bound.arguments.get("group"))
                b = formula(_nbytes(bound.arguments.get(arg)), n) if n > 1 else 0
                counter.calls[name] = counter.calls.get(name, 0) + 1
                counter.bytes[name] = counter.bytes.get(name, 0) + b
            counter._depth.n = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                counter._depth.n = depth

        wrapped._fsharded_counted = True  # type: ignore[attr-defined]
        wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
        return wrapped

    @contextlib.contextmanager
    def counting(self):
        self.calls.clear()
        self.bytes.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def total(self) -> int:
        return sum(self.bytes.values())


# -- the frameworks --------------------------------------------------------------------------


class _Floor:
    """What a data-parallel step costs with no bookkeeping at all: the same forward and
    backward by plain autograd on this rank's rows, the flat gradient reduced over our
    transport, the clipping factor from its norm, and our fused C++ AdamW in place. No
    checks, typing, agreement, key scope or metrics: a bound for the step on this machine
    (an engine can only add to it).

    At stage 0 the gradient is all-reduced and every rank updates every weight. At stages
    1 and 2 (``sharded``) it is reduce-scattered, each rank updates its shard of the flat
    weights (fp32 master = the weights, as ours are) and all-gathers the new weights: the
    least a ZeRO-1/2 step sends and computes (ZeRO-1's all-reduce can only add to it)."""

    def __init__(self, job: Any, params: dict, sharded: bool = False):
        import optree
        import torch.distributed as dist

        import fsharded as fs
        from fsharded import comm

        leaves, self.tdef = optree.tree_flatten(params)
        self.n = dist.get_world_size()
        self.group = comm.axis_group(fs.Mesh({"data": self.n}), ("data",))
        self.job, self.t, self.sharded = job, 0, sharded
        self.sizes = [x.numel() for x in leaves]
        total = sum(self.sizes)
        padded = -(-total // self.n) * self.n if sharded else total
        # The weights live in one flat buffer (the leaves are views of it), so the
        # all-gather writes them in place.
        self.flat = torch.zeros(padded)
        torch.cat([x.detach().reshape(-1) for x in leaves], out=self.flat[:total])
        self.p = [piece.view(x.shape).requires_grad_()
                  for piece, x in zip(self.flat[:total].split(self.sizes), leaves)]
        if sharded:
            k = padded // self.n
            r = dist.get_rank()
            self.master = [self.flat[r * k:(r + 1) * k].clone()]
            self.gshard = torch.empty(k)
            self.gflat = torch.zeros(padded)  # the padding stays zero
            self.own = self.master
        else:
            self.own = [x.detach() for x in self.p]
        self.m = [torch.zeros_like(x) for x in self.own]
        self.v = [torch.zeros_like(x) for x in self.own]

    def __call__(self, global_batch: dict, local_batch: dict) -> torch.Tensor:
        import optree
        import torch.distributed as dist

        from fsharded.kernels import fused_optim
        from fsharded.models import gpt

        loss = gpt.loss(optree.tree_unflatten(self.tdef, self.p), local_batch)
        grads = torch.autograd.grad(loss, self.p)
        lossm = loss.detach().clone()
        dist.all_reduce(lossm)
        if self.sharded:
            torch.cat([g.reshape(-1) for g in grads], out=self.gflat[:sum(self.sizes)])
            _reduce_scatter(self.gshard, self.gflat, self.group)
            self.gshard /= self.n
            sq = self.gshard.square().sum()
            _all_reduce(sq, self.group)
            norm = float(sq.sqrt())
            g = [self.gshard]
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
            _all_reduce(flat, self.group)
            flat /= self.n
            norm = float(flat.norm())
            g = [piece.view(x.shape) for piece, x in zip(flat.split(self.sizes), self.p)]
        factor = min(1.0, self.job.clip / (norm + 1e-6))
        self.t += 1
        with torch.no_grad():
            fused_optim.fused_adamw_(self.own, g, self.m, self.v,
                                     lr=self.job.lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                     weight_decay=self.job.wd, step=self.t, inv_scale=factor,
                                     check_finite=False)
            if self.sharded:
                _all_gather(self.flat, self.master[0], self.group)
        return lossm / self.n


def _all_reduce(x: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    from fsharded.comm import _shm
    if _shm.in_use():
        _shm.all_reduce_(x, "sum", group)
    else:
        dist.all_reduce(x, group=group.group)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    from fsharded.comm import _shm
    if _shm.in_use():
        _shm.reduce_scatter_into(out, x, group)
    else:
        dist.reduce_scatter_tensor(out, x, group=group.group)


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    from fsharded.comm import _shm
    if _shm.in_use():
        _shm.all_gather_into(out, x, group)
    else:
        dist.all_gather_into_tensor(out, x, group=group.group)
