"""One executor for a schedule's table, on both backends.

Each rank walks its list of actions (``_table.Schedule``) in order. ``F`` runs its stage
(``_stages.Stages.forward``) on a micro-batch and keeps the autograd graph; ``B`` runs that
graph backward from the gradient of the stage's output, adding to the stage's parameter
gradients and producing the gradient of its input; ``I`` and ``W`` split ``B``: a stage
whose backward is split runs its forward with its weight products put off
(``_deferred``), ``I`` runs the graph (the input's gradient and the cheap parameter
gradients) and ``W`` computes the put-off weight gradients. ``GATHER`` makes a stage's
weights whole (ZeRO-3: ``run(..., weights=)`` all-gathers its sharded leaves) and
``RELEASE`` hands back the gradients they gathered, transposed to the stored layout
(reduce-scattered), and frees them. ``SEND`` and
``RECV`` move an activation or a gradient through a transport:

- ``Mailbox``: every rank in one process (the virtual mesh). ``run`` interleaves the ranks'
  streams: a rank runs until it needs a value not yet sent, then the next rank goes on.
- ``PointToPoint``: one rank per process, ``torch.distributed`` sends and receives on the
  ``pipe`` axis' group (a blocking receive; sends complete before ``run`` returns).

Both run the same actions in the same order per rank, so they compute the same numbers.
The loss is the mean over the micro-batches (each micro-batch's loss scaled by ``1/m``
before backward), so the gradients are those of the mean loss of the whole batch when
the micro-batches are of equal size.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge
from torch.utils._python_dispatch import _disable_current_modes

from fsharded import _memory_hooks as memory
from fsharded import random as R
from fsharded.comm import _graph_ops
from fsharded.parallel.pipeline._check import check
from fsharded.parallel.pipeline._deferred import Deferred, Deferring, add_into, find_products
from fsharded.parallel.pipeline._stages import Stages
from fsharded.parallel.pipeline._table import WEIGHTS, Action, Schedule

__all__ = ["HEADER_BYTES", "Mailbox", "PointToPoint", "Result", "run"]


class Mailbox:
    """The in-process transport: a value sent waits under its key until it is received."""

    def __init__(self) -> None:
        self._box: dict[tuple, torch.Tensor] = {}
        self._draws: dict[tuple, int] = {}

    def send(self, value: torch.Tensor, key: tuple, src: int, dst: int, draws: int = 0) -> None:
        self._box[(key, src, dst)] = value
        self._draws[(key, src, dst)] = draws

    def ready(self, key: tuple, src: int, dst: int) -> bool:
        return (key, src, dst) in self._box

    def recv(self, key: tuple, src: int, dst: int) -> torch.Tensor:
        return self._box.pop((key, src, dst))

    def draws(self, key: tuple, src: int, dst: int) -> int:
        """The count of keys drawn that came with the value received under ``key``."""
        return self._draws.pop((key, src, dst), 0)

    def begin(self, micro: Any, keyed: bool = False) -> None:
        pass

    def prefetch(self, key: tuple, src: int, dst: int) -> None:
        pass

    def finish(self) -> None:
        if self._box:
            left = ", ".join(f"{k[0]} from {s} to {d}" for k, s, d in self._box)
            raise RuntimeError(f"pipeline: values were sent and never received: {left}")


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_HEAD = 11  # int64 words of a header: dtype, dims, up to 7 sizes, type code, keys drawn
HEADER_BYTES = _HEAD * 8
"""Bytes of the header buffer a receiving rank holds for the first value of each kind."""


class PointToPoint:
    """Point-to-point sends on ``group`` (the ranks along the ``pipe`` axis, ``ranks[i]``
    the global rank of pipe coordinate ``i``), each under a tag naming what it is, so two
    values between the same ranks cannot be mixed up.

    The first value of each kind (an activation or a gradient of a stage) for a shape of
    micro-batch goes with a small header (its dtype, shape and type, and for an activation
    the count of random keys its micro-batch drew before it); later ones go bare,
    their shape known on both sides, and a receive the executor sees coming is posted
    ahead (``prefetch``), so the data arrives while the rank computes. Keep one transport
    for a run of steps: what it learnt of the shapes carries over."""

    def __init__(self, group: Any, ranks: Sequence[int], microbatches: int, *,
                 types: tuple[Callable, Callable] | None = None) -> None:
        self.group, self.ranks, self.m = group, list(ranks), microbatches
        # ``(encode(value) -> int, decode(received, int) -> tensor)``: a value's type (the
        # mesh axes it varies over, inside shard_map) travels in its header.
        self.types = types
        # Unfinished sends of headers and gradients (each holds what it reads), waited on
        # at ``finish``: a rank holds the gradients it sent until the end of the run.
        self._pending: list[Any] = []
        # Activations sent, by key, until they are known received: gloo's send is not seen
        # complete before it is waited on, and the gradient coming back for a micro-batch
        # means its activation arrived (its wait then returns at once). Else a rank would
        # hold every activation it sent until the end of the run, past the table's bound.
        self._acts: dict[tuple, Any] = {}
        # (what, stage, src, dst, shapes) -> (dtype, shape, code, keys drawn before it)
        self._known: dict[tuple, tuple] = {}
        self._posted: dict[tuple, tuple[Any, torch.Tensor]] = {}  # key, src -> (work, buffer)
        self.shapes: tuple = ()  # of the current run's micro-batch (``begin``)
        self.sent_bytes = 0  # every byte this rank has sent (values and headers)

    def begin(self, micro: Any, keyed: bool = False) -> None:
        """A run on micro-batches like ``micro``: values of a kind are shaped alike per shape.
        ``keyed``: under a key scope (every pipe rank alike), the keys drawn counted; a
        run without one draws none, so its values are kinds of their own."""
        self.shapes = (tuple((tuple(x.shape), x.dtype) for x in optree.tree_leaves(micro)
                             if isinstance(x, torch.Tensor)), keyed)

    def _tag(self, key: tuple) -> int:
        what, mb, stage = key
        return ((stage * self.m + mb) * 2 + (what == "grad")) * 2

    def _kind(self, key: tuple, src: int, dst: int) -> tuple:
        return (key[0], key[2], src, dst, self.shapes)

    def send(self, value: torch.Tensor, key: tuple, src: int, dst: int, draws: int = 0) -> None:
        """Send ``value``; ``draws``: the keys its micro-batch's forward has drawn so far
        (the same for every micro-batch: it goes in the header)."""
        value = value.detach().contiguous()
        if value.dtype not in _DTYPES:
            raise TypeError(f"pipeline: cannot send a {value.dtype} activation between stages")
        if value.dim() > 7:
            raise ValueError(f"pipeline: cannot send a {value.dim()}-d value between stages (at most 7 dims)")
        tag, peer, kind = self._tag(key), self.ranks[dst], self._kind(key, src, dst)
        code = self.types[0](value) if self.types is not None else 0
        known = self._known.get(kind)
        traced = _graph_ops.tracing()
        if known is None:  # (while tracing, the header goes now: the receiver's trace needs the shape)
            with _disable_current_modes() if traced else contextlib.nullcontext():
                head = torch.zeros(_HEAD, dtype=torch.int64)
                head[:2 + value.dim()] = torch.tensor([_DTYPES.index(value.dtype), value.dim(), *value.shape])
                head[9], head[10] = code, draws
                self._pending.append(dist.isend(head, peer, group=self.group, tag=tag))
            self.sent_bytes += head.numel() * head.element_size()
            self._known[kind] = (value.dtype, tuple(value.shape), code, draws)
        elif known[:3] != (value.dtype, tuple(value.shape), code):
            raise RuntimeError(f"pipeline: {key[0]} of stage {key[2]} is {value.dtype} {tuple(value.shape)} "
                               f"this time, {known[0]} {known[1]} before, for the same micro-batch shape: a "
                               f"stage whose output shape varies cannot be pipelined")
        elif known[3] != draws:
            raise RuntimeError(f"pipeline: the forward up to stage {key[2]} drew {draws} random keys this time, "
                               f"{known[3]} before: a model whose number of random draws varies from one "
                               f"micro-batch to the next cannot be pipelined with the same keys as without")
        self.sent_bytes += value.numel() * value.element_size()
        if traced:  # an op of the graph (_graph_ops: a copy posted, held until known received)
            _graph_ops.send(value, self.group, peer, tag + 1)
            return
        work = dist.isend(value, peer, group=self.group, tag=tag + 1)
        if key[0] == "act":
            self._acts[(key, dst)] = work
        else:
            self._pending.append(work)

    def ready(self, key: tuple, src: int, dst: int) -> bool:
        return True  # a receive waits for its value

    def prefetch(self, key: tuple, src: int, dst: int) -> None:
        """Post the receive of ``key`` now, if its shape is known (it is received later)."""
        known = self._known.get(self._kind(key, src, dst))
        if known is None or (key, src) in self._posted or _graph_ops.tracing():
            return
        buf = torch.empty(known[1], dtype=known[0])
        work = dist.irecv(buf, self.ranks[src], group=self.group, tag=self._tag(key) + 1)
        self._posted[(key, src)] = (work, buf)

    def recv(self, key: tuple, src: int, dst: int) -> torch.Tensor:
        if _graph_ops.tracing():
            return self._traced_recv(key, src, dst)
        if key[0] == "grad":  # the activation it is the gradient of was received
            sent = self._acts.pop((("act", key[1], key[2] - 1), src), None)
            if sent is not None:
                sent.wait()
        tag, peer, kind = self._tag(key), self.ranks[src], self._kind(key, src, dst)
        if (key, src) in self._posted:
            work, out = self._posted.pop((key, src))
            work.wait()
            code = self._known[kind][2]
        else:
            dtype, shape, code, _ = self._known[kind] if kind in self._known else self._header(kind, peer, tag)
            out = torch.empty(shape, dtype=dtype)
            dist.recv(out, peer, group=self.group, tag=tag + 1)
        return self.types[1](out, code) if self.types is not None else out

    def _header(self, kind: tuple, peer: int, tag: int) -> tuple:
        """Receive the header of the first value of ``kind`` (for real, also while tracing)
        and learn its dtype, shape, type code and keys drawn."""
        with _disable_current_modes():
            head = torch.empty(_HEAD, dtype=torch.int64)
            dist.recv(head, peer, group=self.group, tag=tag)
            nd = int(head[1])
            self._known[kind] = (_DTYPES[int(head[0])], tuple(int(x) for x in head[2:2 + nd]), int(head[9]),
                                 int(head[10]))
        return self._known[kind]

    def _traced_recv(self, key: tuple, src: int, dst: int) -> torch.Tensor:
        """``recv`` as an op of the graph being traced, its shape from the header (received
        now if the kind is new). A gradient's receive releases the copy of the activation
        it is the gradient of."""
        tag, peer, kind = self._tag(key), self.ranks[src], self._kind(key, src, dst)
        dtype, shape, code, _ = self._known[kind] if kind in self._known else self._header(kind, peer, tag)
        after = self._tag(("act", key[1], key[2] - 1)) + 1 if key[0] == "grad" else -1
        out = _graph_ops.recv(shape, dtype, self.group, peer, tag + 1, after)
        return self.types[1](out, code) if self.types is not None else out

    def draws(self, key: tuple, src: int, dst: int) -> int:
        """The count of keys drawn that came (in the header) with values of ``key``'s kind."""
        return self._known[self._kind(key, src, dst)][3]

    def finish(self) -> None:
        for w in [*self._pending, *self._acts.values()]:
            w.wait()
        if _graph_ops.tracing():
            _graph_ops.finish(self.group)
        if self._posted:
            raise RuntimeError(f"pipeline: receives posted and never taken: {sorted(self._posted)}")
        self._pending, self._acts = [], {}


@dataclass
class Result:
    """What ``run`` leaves: ``loss`` (the mean over the micro-batches of the terms of the
    loss the ranks run computed: the last stage's loss, and the extra terms other stages
    return; None where they computed none), ``grads[s]`` (stage ``s``'s parameter gradients,
    for the stages of the ranks run), and per rank: the seconds spent in compute actions
    (``busy_s``; by kind, with their count, in ``spent``), the peak number of
    micro-batches whose activations it held at once; and the run's wall time."""

    loss: torch.Tensor | None
    grads: dict[int, Any]
    busy_s: dict[int, float] = field(default_factory=dict)
    peak_held: dict[int, int] = field(default_factory=dict)
    spent: dict[int, dict[str, tuple[float, int]]] = field(default_factory=dict)
    wall_s: float = 0.0
    spans: dict[int, list[tuple[float, float, Action]]] = field(default_factory=dict)
    """Per rank, each action with its start and end (seconds from the run's start): the
    measured timeline, as ``check``'s plan has the planned one."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """What the stages the ranks run reported (``Stages.metrics``), summed over them and
    meant over the micro-batches."""


class _Rank:
    """One rank's walk through its actions and the values it holds on the way."""

    def __init__(self, r: int, ex: _Run) -> None:
        self.r, self.ex, self.pc = r, ex, 0
        self.actions = ex.schedule.actions[r]
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> its input activation
        self.out_grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> gradient of its output
        self.held: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> (input leaf, output)
        self.drawn: dict[tuple[int, int], int] = {}  # (stage, mb) -> keys its micro-batch drew before it
        self.to_send: dict[tuple, torch.Tensor] = {}
        self.busy = 0.0
        self.spent: dict[str, list] = {}  # kind -> [seconds, count]
        self.spans: list[tuple[float, float, Action]] = []
        self.t0 = 0.0
        self.peak = 0

    def blocked(self) -> bool:
        a = self.actions[self.pc]
        return a.kind == "RECV" and not self.ex.transport.ready(self._key(a), a.peer, self.r)

    @staticmethod
    def _key(a: Action) -> tuple:
        return (a.what, a.mb, a.stage)

    def step(self) -> None:
        a = self.actions[self.pc]
        ex = self.ex
        start = time.perf_counter()
        if a.kind == "SEND":
            v, n = self.to_send.pop(self._key(a))
            ex.transport.send(v, self._key(a), self.r, a.peer, n)
        elif a.kind == "RECV":
            # The next receive is posted before this one is waited for: posting can take a
            # few ms on gloo (its I/O thread busy), time a rank waiting anyway does not lose.
            self._prefetch(self.pc + 1)
            v = ex.transport.recv(self._key(a), a.peer, self.r)
            if ex.counted is not None and self.r in ex.counted and a.peer not in ex.counted:
                v = v.clone()  # made by a rank not counted: a real rank receives into a buffer of its own
            if a.what == "act":
                self.inputs[(a.stage + 1, a.mb)] = v
                self.drawn[(a.stage + 1, a.mb)] = ex.transport.draws(self._key(a), a.peer, self.r)
            else:
                memory.label(v, "gradients")  # (an activation's gradient, for a tracker)
                self.out_grads[(a.stage - 1, a.mb)] = v
        else:
            getattr(self, "_" + a.kind)(a.stage, a.mb)
            dt = time.perf_counter() - start
            if a.kind not in WEIGHTS:  # (a gather or a release is communication, not compute)
                self.busy += dt
            k = self.spent.setdefault(a.kind, [0.0, 0])
            k[0] += dt
            k[1] += 1
        self.spans.append((start - self.t0, time.perf_counter() - self.t0, a))
        self.pc += 1
        if a.kind == "RECV" or self.pc == 1:
            self._prefetch()

    def _prefetch(self, start: int | None = None) -> None:
        """Post the next receive of this rank's list (from action ``start``, default the
        next to run) ahead of it."""
        for a in self.actions[self.pc if start is None else start:]:
            if a.kind == "RECV":
                self.ex.transport.prefetch(self._key(a), a.peer, self.r)
                return

    def _GATHER(self, s: int, i: int) -> None:
        self.ex.gather(s)

    def _RELEASE(self, s: int, i: int) -> None:
        self.ex.release(s)

    def _F(self, s: int, i: int) -> None:
        ex = self.ex
        x = self.inputs.pop((s, i)) if s > 0 else None
        before = self.drawn.pop((s, i), 0)
        # A backward that comes as I then W: the stage's weight products put off.
        sink = Deferred() if (s, i) in ex.split else None
        y, back = ex.diff.forward(functools.partial(ex.stage_fn, s, i, before), ex.stage_params(s), x,
                                  ex.trained.get(s), sink=sink)
        extra, metrics = back.aux
        if metrics:
            ex.metrics[(s, i)] = metrics
        if s == ex.last:
            ex.losses[i] = extra
        else:
            if isinstance(extra, torch.Tensor):  # the stage's own terms of the loss (balancing losses)
                ex.extras[(s, i)] = extra
            self._pass(("act", i, s), s + 1, (s + 1, i), y, self.inputs, ex.drawn.pop((s, i)))
        self.held[(s, i)] = (back, sink)
        self.peak = max(self.peak, len(self.held))

    def _B(self, s: int, i: int) -> None:
        back, _ = self.held.pop((s, i))
        self._backward(s, i, back)

    def _I(self, s: int, i: int) -> None:
        # The graph runs here once: the input's gradient and the parameters' besides the
        # put-off products (norms, biases, embeddings). What W needs is in the sink.
        back, sink = self.held[(s, i)]
        self._backward(s, i, back)
        self.held[(s, i)] = (None, sink)

    def _W(self, s: int, i: int) -> None:
        _, sink = self.held.pop((s, i))
        sink.apply(self.ex.grads[s], self.ex.dtypes[s], self.ex.summed)
        memory.label(self.ex.grads[s], "gradients")

    def _backward(self, s: int, i: int, back: Any) -> None:
        ex = self.ex
        g = None if s == ex.last else self.out_grads.pop((s, i))
        gp, gx = back(g)
        acc = ex.grads[s]
        for k, t in enumerate(gp):
            if t is not None:
                # (in the leaf's own dtype: the stage ran on its compute-dtype copy)
                t = t.to(ex.dtypes[s][k])
                add_into(acc, k, t, ex.summed)
        memory.label(acc, "gradients")  # (the sums are made outside backward)
        if gx is not None:
            self._pass(("grad", i, s), s - 1, (s - 1, i), gx, self.out_grads)

    def _pass(self, key: tuple, to_stage: int, slot: tuple, value: torch.Tensor, local: dict,
              draws: int = 0) -> None:
        """Hand ``value`` to stage ``to_stage``: in place if this rank holds it, else by a
        send (with ``draws``, the keys its micro-batch has drawn so far)."""
        if self.ex.schedule.rank_of(to_stage) == self.r:
            local[slot] = value
            if key[0] == "act":
                self.drawn[slot] = draws
        else:
            self.to_send[key] = value, draws


@dataclass
class _Run:
    schedule: Schedule
    stages: Stages
    params: dict[int, Any]
    micro: Sequence[Any]
    transport: Any
    dtypes: dict[int, list[torch.dtype]]  # stage -> its leaves' own dtypes (its gradients add up in them)
    grads: dict[int, list]
    split: frozenset  # the (stage, micro-batch)s whose backward runs as I then W
    diff: Any
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    trained: dict[int, list[bool]] = field(default_factory=dict)
    keys: Any = None  # (the enclosing KeyScope, one reserved key per micro-batch), or None
    counted: Any = None  # the ranks a memory tracker counts (None: all)
    state: Any = None  # the model state the stages read (Stages.block_state), or None
    summed: set = field(default_factory=set)  # ids of the gradient sums made here (added to in place)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    extras: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (stage, mb) -> its loss terms
    metrics: dict[tuple[int, int], dict] = field(default_factory=dict)  # (stage, mb) -> what it reported
    drawn: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, mb) -> keys drawn after it
    weights: Any = None  # (stage, its stored params) -> (its whole params, the transpose of that), or None
    stored: dict[int, Any] = field(default_factory=dict)  # stage -> its params as stored (the table gathers them)
    compute_dtype: torch.dtype | None = None
    uncast: dict[int, list[bool]] = field(default_factory=dict)  # stage -> its leaves kept in their dtype
    transposes: dict[int, Callable] = field(default_factory=dict)  # stage -> what its release runs
    arriving: dict[int, Any] = field(default_factory=dict)  # stage -> its gather in flight
    released: dict[int, list] = field(default_factory=dict)  # stage -> its stored params' gradients so far

    def gather(self, s: int) -> None:
        """``GATHER``: stage ``s``'s weights whole (``weights``; without it, as stored),
        in the compute dtype; their gradients add up from zero. Weights that arrive later
        (an object with ``wait()``: a gather in flight) are waited for at their first use."""
        whole, back = self.weights(s, self.stored[s]) if self.weights is not None else (self.stored[s], None)
        self.transposes[s] = back
        if hasattr(whole, "wait"):
            self.arriving[s] = whole
        else:
            self._hold(s, whole)

    def _hold(self, s: int, whole: Any) -> None:
        leaves = optree.tree_leaves(whole)
        memory.label(leaves, "parameters")
        self.dtypes[s] = [t.dtype for t in leaves]
        # (the weights in their own dtype freed, if cast)
        self.params[s] = _cast(whole, self.compute_dtype, self.uncast.get(s))
        self.grads[s] = [None] * len(leaves)

    def stage_params(self, s: int) -> Any:
        """Stage ``s``'s weights as it computes on them (waited for if they are arriving)."""
        if s in self.arriving:
            self._hold(s, self.arriving.pop(s).wait())
        return self.params[s]

    def release(self, s: int) -> None:
        """``RELEASE``: the gradients stage ``s``'s whole weights gathered, transposed to
        the stored layout (reduce-scattered) and added to the stage's; the weights freed."""
        self.stage_params(s)
        got, back = self.grads.pop(s), self.transposes.pop(s)
        for t in got:  # freed below: their ids may come again, for tensors not made here
            if t is not None:
                self.summed.discard(id(t))
        if back is not None:
            got = back(got)
        acc = self.released.setdefault(s, [None] * len(got))
        for k, t in enumerate(got):
            if t is not None:
                add_into(acc, k, t, self.summed)
        memory.label(acc, "gradients")
        del self.params[s], self.dtypes[s]

    def _keyed(self, s: int, i: int, before: int) -> Any:
        """Random draws of stage ``s`` on micro-batch ``i`` take the keys they take
        without pipelining: micro-batch ``i``'s stream (as accumulation reserves one per
        micro-batch), from where the stages before stopped (``before``; a stage that
        replays the forward from its start (``Stages.replays``) from the start)."""
        if self.keys is None:
            self.drawn[(s, i)] = 0
            return contextlib.nullcontext()
        mode, streams = self.keys
        return _stream(mode, streams[i], 0 if self.stages.replays else before, self.drawn, (s, i))

    def stage_fn(self, s: int, i: int, before: int, p: Any, x: torch.Tensor | None) -> tuple:
        """Stage ``s`` on micro-batch ``i``: ``(output, aux)``; the last stage's output is its
        loss (in fp32), scaled (fp16's loss scale) and over ``m`` (the mean over
        micro-batches is their sum), and its aux ``(the loss, its metrics)``. Another
        stage's output is its activation, or ``(activation, its extra loss terms so
        scaled)``, with aux ``(those terms or (), its metrics)``."""
        with self._keyed(s, i, before):
            y = self.stages.forward(s, p, x, self.micro[i], state=self.state)
        y, extra, metrics = y if isinstance(y, tuple) else (y, None, {})
        metrics = {k: v.detach().float() for k, v in metrics.items()}
        if s == self.last:
            y = y.float()
            return (y if self.scale is None else self.scale(y)) / self.m, (y.detach(), metrics)
        if extra is not None:
            extra = extra.float()
            return (y, (extra if self.scale is None else self.scale(extra)) / self.m), (extra.detach(), metrics)
        return y, ((), metrics)  # (torch.func's aux takes no None)

    @property
    def m(self) -> int:
        return self.schedule.microbatches

    @property
    def last(self) -> int:
        return self.stages.n - 1


@contextlib.contextmanager
def _stream(mode: Any, key: Any, start: int, drawn: dict, at: tuple):
    """Under ``mode`` (a ``KeyScope``): draw from ``key``'s stream from position ``start``,
    and note in ``drawn[at]`` where the stream stood after. ``key`` an int: the scope's
    own stream, from that position on (one micro-batch: the loss draws as it does
    unpipelined)."""
    if isinstance(key, int):
        mode.calls = key + start
        yield
        drawn[at] = mode.calls - key
        return
    with mode.rekeyed(key):
        mode.calls = start
        yield
        drawn[at] = mode.calls

class _Back:
    """What a forward keeps for its backward: ``back(g) -> (parameter gradients in leaf
    order, the input's gradient or None)`` (``g`` None: the loss's own, 1)."""

    def __init__(self, fn: Callable, aux: Any) -> None:
        self.fn, self.aux = fn, aux

    def __call__(self, g: torch.Tensor | None) -> tuple[list, torch.Tensor | None]:
        return self.fn(g)


class Autograd:
    """Differentiate with plain autograd (a process per rank, nothing transformed).
    ``trained``: which of the stage's leaves are differentiated (None: all); the others
    enter as constants and get no gradient (None). ``sink`` (a ``Deferred``): the
    backward is split; the products ``find_products`` finds in the graph are put off,
    their leaves' gradients filed with it (and None in what ``back`` gives)."""

    def forward(self, fn: Callable, params: Any, x: torch.Tensor | None,
                trained: list[bool] | None = None, sink: Deferred | None = None) -> tuple[torch.Tensor, _Back]:
        leaves, tdef = optree.tree_flatten(params)
        mask = [True] * len(leaves) if trained is None else trained
        leaves = [t.detach().requires_grad_(m) for t, m in zip(leaves, mask)]
        xl = None if x is None else x.detach().requires_grad_()
        with torch.enable_grad():  # a step's body runs without grad mode
            y, aux = fn(optree.tree_unflatten(tdef, leaves), xl)
        products = []
        if sink is not None:
            outs = y if isinstance(y, tuple) else (y,)
            roots = [t.grad_fn for t in outs if t.grad_fn is not None]
            seeded = {id(t) for t in outs}  # a leaf that is an output takes its seed directly
            products = find_products(roots, [t if m and id(t) not in seeded else None for t, m in zip(leaves, mask)])
        put_off = {p.leaf for p in products}
        want_p = [t for k, (t, m) in enumerate(zip(leaves, mask)) if m and k not in put_off]
        got_mask = [m and k not in put_off for k, m in enumerate(mask)]

        def back(g):
            want = ([xl] if xl is not None else []) + want_p
            edges = [GradientEdge(p.node, 0) for p in products]
            if not want and not edges:  # a first stage whose every leaf is frozen: nothing to differentiate
                return [None] * len(mask), None
            outs, seeds = _seeds(y, g)
            with torch.enable_grad():
                got = torch.autograd.grad(outs, want + edges, seeds, allow_unused=True)
            for p, gp in zip(products, got[len(want):]):
                sink.add(p.leaf, p, None, gp)
            got = list(got[:len(want)])
            return _spread(got[len(want) - len(want_p):], got_mask), (got[0] if xl is not None else None)
        return _activation(y).detach(), _Back(back, aux)


class Functional:
    """Differentiate with ``torch.func.vjp`` (inside a virtual mesh's vmap levels, where
    autograd's leaves cannot be made); ``trained`` as for ``Autograd``; ``sink``: the
    forward runs under ``Deferring`` (the graph cannot be read here)."""

    def forward(self, fn: Callable, params: Any, x: torch.Tensor | None,
                trained: list[bool] | None = None, sink: Deferred | None = None) -> tuple[torch.Tensor, _Back]:
        leaves, tdef = optree.tree_flatten(params)
        mask = [True] * len(leaves) if trained is None else trained

        def on(primal: list, *xs):  # the trained leaves as primals, the others constants
            it = iter(primal)
            p = optree.tree_unflatten(tdef, [next(it) if m else t for t, m in zip(leaves, mask)])
            with Deferring(optree.tree_leaves(p), sink) if sink is not None else contextlib.nullcontext():
                return fn(p, *xs)
        primal = [t for t, m in zip(leaves, mask) if m]
        if x is None and not primal:  # a first stage whose every leaf is frozen
            y, aux = fn(params, None)
            return _activation(y), _Back(lambda g: ([None] * len(mask), None), aux)
        if x is None:
            y, vjp, aux = torch.func.vjp(lambda p: on(p, None), primal, has_aux=True)
        else:
            y, vjp, aux = torch.func.vjp(on, primal, x, has_aux=True)

        def back(g):
            _, seeds = _seeds(y, g)
            out = vjp(tuple(seeds) if isinstance(y, tuple) else seeds[0])
            return _spread(list(out[0]), mask), (out[1] if x is not None else None)
        return _activation(y), _Back(back, aux)


def _cast(params: Any, dtype: torch.dtype | None, keep: list[bool] | None = None) -> Any:
    """``params`` with its floating leaves in ``dtype`` (None: as they are), except those
    ``keep`` marks (in leaf order)."""
    if dtype is None:
        return params
    leaves, tdef = optree.tree_flatten(params)
    keep = keep or [False] * len(leaves)
    return optree.tree_unflatten(tdef, [t if k or not t.is_floating_point() else t.to(dtype)
                                        for t, k in zip(leaves, keep)])


def _seeds(y: Any, g: torch.Tensor | None) -> tuple[list, list]:
    """What a stage's backward differentiates and with which cotangents: its output with
    ``g`` (None: the loss's own, 1), and its extra loss terms, if any, with 1."""
    if isinstance(y, tuple):
        return list(y), [g, torch.ones_like(y[1])]
    return [y], [torch.ones_like(y) if g is None else g]


def _activation(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple) else y


def _spread(got: list, mask: list[bool]) -> list:
    """The trained leaves' gradients in leaf order, None at the others."""
    it = iter(got)
    return [next(it) if m else None for m in mask]


def run(schedule: Schedule, stages: Stages, params: dict[int, Any], micro: Sequence[Any], *,
        ranks: Sequence[int] | None = None, transport: Any = None, functional: bool = False,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        trained: dict[int, list[bool]] | None = None, compute_dtype: torch.dtype | None = None,
        counted: Sequence[int] | None = None, state: Any = None, weights: Callable | None = None,
        uncast: dict[int, list[bool]] | None = None) -> Result:
    """Run ``schedule`` for the ranks ``ranks`` (default: all of them, in this process,
    over a ``Mailbox``; on real ranks pass this rank alone and a ``PointToPoint``).
    ``params[s]``: stage ``s``'s parameters (``Stages.params_of``) for every stage the
    ranks hold; ``micro``: the ``m`` micro-batches; ``functional``: differentiate with
    ``torch.func`` (inside vmap) instead of autograd; ``scale``: applied to each
    micro-batch's loss before backward (fp16's loss scale: the gradients come back
    scaled, the loss does not); ``trained[s]``: which of stage ``s``'s leaves are
    differentiated (default all; the others' gradients come back as zeros);
    ``compute_dtype``: the stages run on their parameters cast to it (but for the leaves
    ``uncast[s]`` marks, in stage ``s``'s leaf order: their ``run_block`` casts them where
    it gathers them); ``counted``: the
    ranks whose allocations a memory tracker counts (default all; a dry run of one rank's
    step runs the others' actions for their values only); ``state``: a model state the
    stages' blocks read (``Stages.block_state``: aux-loss-free routing biases), their
    stats reported beside the metrics. ``weights(s, params[s]) -> (whole, transpose)``: a
    table with weight actions (``with_gathers``) gathers stage ``s``'s weights at its
    ``GATHER`` (``params`` holds them as stored: ZeRO-3's shards) and at its ``RELEASE``
    hands ``transpose`` the gradients of ``whole``, a list in its leaf order (None where a
    leaf got none), to get those of ``params[s]``; without it a gather takes the weights
    as they are. The table is
    checked first (``check``): one that cannot run is refused before any action runs."""
    check(schedule)
    if stages.n != schedule.stages:
        raise ValueError(f"pipeline: the schedule has {schedule.stages} stages ({schedule.ranks} ranks x "
                         f"{schedule.virtual} per rank), the model was cut into {stages.n}")
    if len(micro) != schedule.microbatches:
        raise ValueError(f"pipeline: the schedule runs {schedule.microbatches} micro-batches, got {len(micro)}")
    ranks = list(range(schedule.ranks)) if ranks is None else list(ranks)
    transport = Mailbox() if transport is None else transport
    mine = [s for s in range(stages.n) if schedule.rank_of(s) in ranks]
    gathers = any(a.kind == "GATHER" for r in range(schedule.ranks) for a in schedule.actions[r])
    if weights is not None and not gathers:
        raise ValueError("pipeline: weights= gathers a stage's weights at its GATHER actions, and the table has "
                         "none: make it with with_gathers(schedule)")
    stored = {s: params[s] for s in mine}
    leaves = {s: optree.tree_leaves(params[s]) for s in mine}
    # One copy per stage in the compute dtype for the run (or for a gather), not one per micro-batch
    uncast = dict(uncast or {})
    params = {} if gathers else {s: _cast(params[s], compute_dtype, uncast.get(s)) for s in mine}
    split = frozenset((a.stage, a.mb) for r in ranks for a in schedule.actions[r] if a.kind == "I")
    # Under a key scope (a step's): one stream per micro-batch, reserved in order, as
    # gradient accumulation reserves them (derived only if a stage draws).
    mode = R.innermost()
    keys = None
    if mode is not None:  # (one micro-batch draws from the scope's own stream, as an unpipelined loss does)
        keys = (mode, [mode.calls] if schedule.microbatches == 1 else
                [mode.reserve() for _ in range(schedule.microbatches)])
    ex = _Run(schedule, stages, params, micro, transport,
              {} if gathers else {s: [t.dtype for t in leaves[s]] for s in mine},
              {} if gathers else {s: [None] * len(leaves[s]) for s in mine}, split,
              Functional() if functional else Autograd(), scale, dict(trained or {}), keys,
              None if counted is None else set(counted), state, weights=weights, stored=stored,
              compute_dtype=compute_dtype, uncast=uncast)
    transport.begin(micro[0], keys is not None)
    walkers = [_Rank(r, ex) for r in ranks]
    t0 = time.perf_counter()
    for w in walkers:
        w.t0 = t0
    while True:
        moved = False
        for w in walkers:
            with memory.paused() if counted is not None and w.r not in counted else contextlib.nullcontext():
                while w.pc < len(w.actions) and not w.blocked():
                    w.step()
                    moved = True
        if all(w.pc == len(w.actions) for w in walkers):
            break
        if not moved:
            stuck = "; ".join(f"rank {w.r} at {w.actions[w.pc]}" for w in walkers if w.pc < len(w.actions))
            raise RuntimeError(f"pipeline: no rank can go on ({stuck}): the schedule deadlocks")
    transport.finish()
    wall = time.perf_counter() - t0
    grads = {}
    for s in mine:
        mask = ex.trained.get(s) or [True] * len(leaves[s])
        got = ex.released.get(s, [None] * len(leaves[s])) if gathers else ex.grads[s]
        # (an untrained leaf's zeros hold no memory: a broadcast 0)
        filled = [g if g is not None else torch.zeros_like(p) if m else p.new_zeros(()).expand(p.shape)
                  for p, g, m in zip(leaves[s], got, mask)]
        grads[s] = optree.tree_unflatten(optree.tree_structure(stored[s]), filled)
    loss = None
    if schedule.rank_of(stages.n - 1) in ranks:
        loss = torch.stack([ex.losses[i] for i in range(schedule.microbatches)]).mean()
    if ex.extras:  # the other stages' terms of the loss, meant over the micro-batches as well
        extra = torch.stack(list(ex.extras.values())).sum() / schedule.microbatches
        loss = extra if loss is None else loss + extra
    metrics: dict[str, torch.Tensor] = {}
    for m in ex.metrics.values():
        for k, v in m.items():
            metrics[k] = v / schedule.microbatches + metrics.get(k, 0)
    return Result(loss, grads, {w.r: w.busy for w in walkers}, {w.r: w.peak for w in walkers},
                  {w.r: {k: (v[0], v[1]) for k, v in w.spent.items()} for w in walkers}, wall,
                  {w.r: w.spans for w in walkers}, metrics)
