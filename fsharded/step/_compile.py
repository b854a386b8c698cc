"""The step captured once per input signature as one graph and compiled (``compile=True``).

``Captured(fn)`` wraps a step body that takes and returns pytrees of tensors (the
shard-mapped step's ``local``). The first call with a signature (the tree structure, and
each leaf's shape, dtype and device) traces ``fn`` with ``make_fx`` on fake tensors:
forward, backward (autograd runs while tracing, so every custom ``autograd.Function``
enters the graph through the backward it really runs, not through a re-derivation),
the reductions, the gradient transformation and the update, as aten ops in one graph.
The varying-axes typing and the step's other Python logic run at trace time only. The
graph is then compiled with Inductor (``torch.compile``, static shapes) and cached; a
later call with the same signature runs the compiled graph, another signature captures
again (``compiles`` counts the captures).

What may not be in the graph, checked on every capture (an error naming the op):

- a read of a value on the host (``aten._local_scalar_dense``, ``item``): under fake
  tensors such a read fails while tracing; the check is the second line;
- a call of torch.distributed's own (in-place) collectives or point-to-point ops
  (``c10d.*``): traced, they work on buffers outside the graph's values, so the graph
  would drop them; fsharded's collectives enter it as functional ops;
- a draw from torch's global generator (an op tagged ``nondeterministic_seeded``):
  Inductor's generator would give other numbers than eager's; the step's random ops draw
  from its keys (``fs.random``), which are tensors of the state.

>>> run = Captured(sm.local)
>>> out = run(state, batch)  # captured and compiled once, then run
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import make_fx

from fsharded import optim
from fsharded.comm import _graph_ops
from fsharded.optim._base import given_rates
from fsharded.spmd._wrappers import capturing

__all__ = ["Captured", "StepGraphs", "host_reads", "global_draws", "eager_collectives"]

_HOST_READS = ("aten._local_scalar_dense", "aten.item")


def _ops(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def host_reads(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of ``gm`` that read a value back to the host."""
    return [str(n.target) for n in _ops(gm) if any(str(n.target).startswith(h) for h in _HOST_READS)]


def eager_collectives(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of ``gm`` that are torch.distributed's in-place calls (``c10d.*``: a send,
    a receive into a buffer, an all-reduce in place), not the functional collectives."""
    return [str(n.target) for n in _ops(gm) if str(n.target).startswith("c10d.")]


def global_draws(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of ``gm`` that draw from torch's global generator."""
    out = []
    for n in _ops(gm):
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            out.append(str(n.target))
    return out


# Ops whose output layout the fake tensors' rule says is contiguous while the real kernel
# may lay it out otherwise (advanced indexing under vmap: the batch dims' index tensors
# restride it). A view the graph takes of such an output assumes the fake layout.
_LAYOUT_FREE = (torch.ops.aten.index.Tensor,)


def _pin_layouts(gm: torch.fx.GraphModule) -> None:
    """After each op of ``_LAYOUT_FREE`` whose traced output is contiguous, a contiguous
    copy, so what follows it sees the layout it was traced with (Inductor fuses the copy
    into the op)."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _LAYOUT_FREE:
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_contiguous():
            continue
        with gm.graph.inserting_after(n):
            c = gm.graph.call_function(torch.ops.aten.clone.default, (n,),
                                       {"memory_format": torch.contiguous_format})
        c.meta["val"] = val
        n.replace_all_uses_with(c, delete_user_cb=lambda user, c=c: user is not c)


def _signature(leaves: list) -> tuple:
    with torch._C.DisableTorchFunction():
        return tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else (type(x), x)
                     for x in leaves)


class _Graph:
    """One captured signature: the traced graph, its compiled form, the output tree and
    ``mutated``, the positions of the arguments the graph writes into (``copy_`` to a
    placeholder: a donated state's buffers)."""

    def __init__(self, gm: torch.fx.GraphModule, run: Callable, out_def: Any, mutated: frozenset = frozenset()) -> None:
        self.gm, self.run, self.out_def, self.mutated = gm, run, out_def, mutated


class Captured:
    """``fn`` (tensor pytrees in, tensor pytrees out, no host reads) captured per input
    signature and compiled with Inductor. ``__call__(*args)`` gives ``fn``'s result;
    ``last_compile_s`` the seconds the last call spent capturing and compiling (0 when it
    ran a graph already compiled: the first run of a graph compiles it, so that call's
    time is counted whole); ``compiles`` how many signatures were captured."""

    def __init__(self, fn: Callable, *, what: str = "train_step", backend: str = "inductor") -> None:
        self.fn, self.what, self.backend = fn, what, backend
        self.graphs: dict[tuple, _Graph] = {}
        self.compiles = 0
        self.last_compile_s = 0.0

    def __call__(self, *args: Any) -> Any:
        leaves, tdef = optree.tree_flatten(args)
        key = (tdef, _signature(leaves))
        g = self.graphs.get(key)
        self.last_compile_s = 0.0
        if g is None:
            t0 = time.perf_counter()
            try:
                g = self._capture(leaves, tdef)
            except NotImplementedError:  # (a form not built: said as it is, nothing run)
                raise
            except Exception as e:  # noqa: BLE001 - said below, with the eager step's own error if it has one
                self._explain(args, e)
                raise
            # torch.compile compiles on this first call, then runs. A graph that writes into
            # its inputs (donated state) runs it on copies of them: a failure, while
            # compiling or running, leaves the state passed in as it was (explained from
            # it, or run eagerly under compile=auto); this first step's peak is a pure
            # step's, and the later ones write in place.
            run_on = [x.clone() if i in g.mutated else x for i, x in enumerate(leaves)]
            try:
                out = g.run(*run_on)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - said below
                self._explain(args, e)
                raise
            self.graphs[key] = g
            self.last_compile_s = time.perf_counter() - t0
        else:
            out = g.run(*leaves)
        return optree.tree_unflatten(g.out_def, list(out))

    def _explain(self, args: tuple, e: Exception) -> None:
        """After a capture or a first compiled run failed with ``e`` before changing
        anything: the eager step's own error where it has one (bad input is said as
        eagerly: the traced stand-ins do not check everything the kernels do), else ``e``
        said as the capture's. The state passed in is as it was (a graph writing into
        its inputs ran on copies of them)."""
        try:
            self.fn(*args)
        except Exception as eager:  # noqa: BLE001 - re-raised as it is
            raise eager from e
        if isinstance(e, RuntimeError) and str(e).startswith(f"{self.what}(compile=True)"):
            return  # (already ours: the caller re-raises it)
        raise RuntimeError(f"{self.what}(compile=True): capturing or compiling the step failed, although it runs "
                           f"eagerly ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass "
                           f"compile=False") from e

    def graph(self, *args: Any) -> torch.fx.GraphModule:
        """The traced graph for ``args``' signature (captured if it is not yet)."""
        leaves, tdef = optree.tree_flatten(args)
        key = (tdef, _signature(leaves))
        if key not in self.graphs:
            self.graphs[key] = self._capture(leaves, tdef)
        return self.graphs[key].gm

    def _capture(self, leaves: list, tdef: Any) -> _Graph:
        out_def: list = []
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        fixed = list(leaves)

        def flat(*tensors: torch.Tensor) -> list:
            xs = list(fixed)
            for i, t in zip(positions, tensors):
                xs[i] = t
            out = self.fn(*optree.tree_unflatten(tdef, xs))
            out_leaves, od = optree.tree_flatten(out)
            out_def.append(od)
            bad = [type(x).__name__ for x in out_leaves if not isinstance(x, torch.Tensor)]
            if bad:
                raise TypeError(f"{self.what}(compile=True): the step returned non-tensor leaves ({bad})")
            last = _graph_ops.end()  # (an output: no op of the chain is dead code, a send's included)
            return out_leaves + ([last] if last is not None else [])

        tensors = [leaves[i] for i in positions]
        try:
            with capturing():
                gm = make_fx(flat, tracing_mode="fake")(*tensors)
            if _graph_ops.kinds(gm) == {"shm", "functional"}:  # one transport per graph: see _graph_ops
                with capturing(), _graph_ops.functional_only():
                    gm = make_fx(flat, tracing_mode="fake")(*tensors)
        finally:
            _graph_ops.reset()
        if {"p2p", "functional"} <= _graph_ops.kinds(gm):
            raise NotImplementedError(
                f"{self.what}(compile=True): this pipelined step's other collectives run over the process "
                f"group's own backend (not the same-host shared-memory transport), and a graph does not yet "
                f"order the pipeline's sends and receives with those; pass compile=False")
        eager = eager_collectives(gm)  # (before dead code goes: their outputs are unused)
        if eager:
            raise RuntimeError(
                f"{self.what}(compile=True): the step calls torch.distributed directly ({sorted(set(eager))}): "
                f"such a call works in place on its buffers, outside the graph's values, so the graph would "
                f"drop or misplace it. Use fsharded's collectives (fs.lax / fs.comm), which enter the graph as "
                f"functional ops, or pass compile=False")
        gm.graph.eliminate_dead_code()
        _pin_layouts(gm)
        gm.recompile()
        reads, draws = host_reads(gm), global_draws(gm)
        if reads:
            raise RuntimeError(f"{self.what}(compile=True): the captured step reads values on the host "
                               f"({sorted(set(reads))}); it cannot run as one graph. Pass compile=False")
        if draws:
            raise RuntimeError(
                f"{self.what}(compile=True): the loss draws from torch's global generator "
                f"({sorted(set(draws))}), which a compiled graph would draw other numbers from than eager "
                f"does. Draw from the step's key instead (fs.random, or the nn ops the step's key scope "
                f"covers), or pass compile=False")
        compiled = torch.compile(gm, backend=self.backend, fullgraph=True, dynamic=False)
        self.compiles += 1

        n_out = out_def[-1].num_leaves

        def run(*xs: Any) -> Any:
            return list(compiled(*[xs[i] for i in positions]))[:n_out]

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        written = {n.args[0] for n in _ops(gm) if n.target is torch.ops.aten.copy_.default}
        mutated = frozenset(positions[k] for k, n in enumerate(placeholders) if n in written)
        return _Graph(gm, run, out_def[-1], mutated)


class StepGraphs:
    """A train step's captured graphs: one ``Captured`` per shard-mapped step (a state
    layout's plan) and per set of learning-rate inputs.

    The update's rates are computed before each call, from the optimizer state's counters
    (as the step's guard checks them), and passed as inputs of the graph
    (``optim._base.given_rates``): the graph holds no schedule, so another schedule or run
    length (``--steps``) runs the same graph, from Inductor's cache across runs. A
    ``scale_by_learning_rate`` that ``optim.scheduled_lrs`` does not reach, or reaches
    twice, computes its schedule in the graph. With a ``verdict`` (donated state) the
    graph writes the new state into the one passed in (``donated``)."""

    def __init__(self) -> None:
        self._graphs: dict = {}

    def clear(self) -> None:
        self._graphs.clear()

    @property
    def compiles(self) -> int:
        return sum(run.compiles for _, run in self._graphs.values())

    def get(self, sm: Any, state: Any, *, optimizer: Any, backend: str,
            verdict: Callable[[dict], torch.Tensor | None] | None) -> tuple[Captured, list]:
        """The captured form of ``sm`` (its ``local``) for ``state``, and the rates to pass
        it as its third argument."""
        rates = optim.scheduled_lrs(optimizer, state.opt_state)
        tokens = tuple(getattr(r, "token", None) for r in rates)
        if None in tokens or len(set(tokens)) < len(tokens):
            tokens = ()
        key = id(sm), tokens
        if key not in self._graphs:
            def local(state: Any, batch: Any, values: list, tokens: tuple = tokens) -> Any:
                with given_rates(dict(zip(tokens, values))):
                    new, metrics = sm.local(state, batch)
                if verdict is not None and _tracing(state):
                    new = donated(state, new, verdict(metrics))
                return new, metrics
            self._graphs[key] = (sm, Captured(local, backend=backend))  # (sm kept: its id stays)
        values = [torch.as_tensor(lr).to(torch.as_tensor(c).device).detach() for c, lr in rates] if tokens else []
        return self._graphs[key][1], values


def _tracing(state: Any) -> bool:
    """Whether ``state`` is the fake stand-in of a capture (not a real call of the body:
    the eager run that explains a failed capture consumes nothing)."""
    return any(is_fake(x) for x in optree.tree_leaves(state.params) if isinstance(x, torch.Tensor))


def donated(old: Any, new: Any, ok: torch.Tensor | None) -> Any:
    """``new`` (a ``TrainState``) written into ``old``'s parameters and optimizer moments
    (donated buffers, as the eager step updates them in place) and returned as those
    buffers: in a captured graph an input mutated at its end, so the compiler writes the
    update into the state's own memory instead of a second copy of it. Where the step's
    verdict ``ok`` is false (a non-finite step the guard refuses or skips) each keeps its
    old value. Counters and other 0-d leaves stay new tensors (the guard advances a skipped
    step's from the old)."""
    copies: list = []

    def into(o: Any, n: Any) -> Any:
        if (not isinstance(o, torch.Tensor) or not isinstance(n, torch.Tensor) or o is n or o.dim() == 0
                or o.shape != n.shape or o.dtype != n.dtype or o.device != n.device
                or any(st == 0 and sz > 1 for st, sz in zip(o.stride(), o.shape))):  # (a broadcast placeholder)
            return n
        # The values first, all of them, then the writes: no write changes a value another
        # leaf still takes (a new leaf that is a view of an old one).
        src = torch.where(ok, n, o) if ok is not None else (n.clone() if n._is_view() else n)
        copies.append((o, src))
        return o
    out = new._replace(params=optree.tree_map(into, old.params, new.params, none_is_leaf=True),
                       opt_state=optree.tree_map(into, old.opt_state, new.opt_state, none_is_leaf=True))
    for o, src in copies:
        o.copy_(src)
    return out
