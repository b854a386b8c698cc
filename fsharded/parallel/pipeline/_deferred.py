"""Weight gradients put off: what lets a zero-bubble schedule split a backward into ``I``
(the input's gradient, which the previous stage waits for) and ``W`` (the weights',
which nothing waits for). Two ways, one per differentiator:

- plain autograd (real ranks): the forward runs as it is. ``find_products`` then reads
  its graph: a parameter whose one use is a matrix product (``mm``, ``bmm``, ``addmm``,
  reached through view-like nodes: einsum's permutes and reshapes, a transpose, a
  cast) is put off. ``I`` asks autograd for the gradient at each such product's output
  instead of the parameter's, so the product's backward computes the activation side
  only; ``W`` multiplies that gradient with the product's other operand (which the node
  saved) and runs the view-like nodes back to the parameter's shape.
- inside torch.func's transforms (the virtual mesh), where the graph cannot be read:

While a stage's forward runs under ``Deferring``, every product of an activation with a
parameter (``x @ w``, ``F.linear``, a two-operand ``einsum``) runs as one autograd node
whose backward computes the activation's gradient only and files ``(x, grad_out)`` with
the micro-batch's ``Deferred``; ``Deferred.apply`` later computes each weight gradient
from them (the same contraction autograd would run, only later). Everything else a
parameter takes part in (norms, biases, embedding lookups: cheap) keeps its gradient in
the input's backward.

For ``y = einsum("A,B->C", x, w)``: ``dx = einsum("C,B->A", g, w)`` and ``dw =
einsum("A,C->B", x, g)``, valid when no subscript repeats within an operand and every
subscript of one operand appears in the other or in the output (checked; a product that
fails it is not put off).
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fsharded import _memory_hooks as memory

__all__ = ["Deferring", "Deferred", "Product", "add_into", "find_products"]

_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


class Deferred:
    """The weight gradients one stage's backward put off for one micro-batch."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []  # (leaf, eq for dw, x, g)

    def add(self, k: int, eq: str | Product, x: torch.Tensor | None, g: torch.Tensor) -> None:
        """Leaf ``k``'s part: ``w``'s gradient of ``einsum(eq, x, w)`` given ``g``, or of a
        product node of the graph (``eq`` a ``Product``, ``x`` None) given ``g``."""
        self.parts.append((k, eq, x, g))

    def apply(self, grads: list, dtypes: list | None = None, summed: set | None = None) -> None:
        """Add each put-off weight gradient to ``grads[k]`` (None: not yet any), in
        ``dtypes[k]`` where given (the leaf's own, when the stage ran on a cast of it);
        ``summed``: as ``add_into`` takes it."""
        for k, eq, x, g in self.parts:
            with torch.no_grad():  # (x is an activation that requires grad: no graph of this)
                dw = _weight_grad(eq, x, g) if isinstance(eq, str) else eq.weight_grad(g)
            if dtypes is not None:
                dw = dw.to(dtypes[k])
            memory.label(dw, "gradients")  # (for a tracker: made outside backward)
            add_into(grads, k, dw, summed if summed is not None else set())
        self.parts = []


def add_into(grads: list, k: int, t: torch.Tensor, summed: set) -> None:
    """``grads[k] += t`` (``grads[k]`` None: ``t``): in place where ``grads[k]`` is a sum
    made here (its id in ``summed``), else a new sum, which is then. A gradient autograd
    hands back may be a view or a broadcast (of a sum's ones), never added to in place."""
    acc = grads[k]
    if acc is None:
        grads[k] = t
    elif id(acc) in summed:
        with torch.no_grad():
            acc.add_(t)
    else:
        with torch.no_grad():
            grads[k] = acc + t
        summed.add(id(grads[k]))


# The products of a matrix multiply (x @ w) and of F.linear (x @ w.T): their weight
# gradients as one matrix product of the rows flattened, not a general einsum.
_MM, _LINEAR = "...k,kn->...n", "...k,nk->...n"


def _weight_grad(eq: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``w``'s gradient for ``y = einsum(eq, x, w)`` given ``g``, ``y``'s gradient."""
    if eq == _MM:
        return torch.mm(x.reshape(-1, x.shape[-1]).t(), g.reshape(-1, g.shape[-1]))
    if eq == _LINEAR:
        return torch.mm(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
    flat = _flat(eq)
    if flat is not None:  # x (P..., K...), w (K..., N...), y (P..., N...): one matrix product
        k, n = flat
        kd, nd = x.shape[x.dim() - k:], g.shape[g.dim() - n:]
        return torch.mm(x.reshape(-1, kd.numel()).t(), g.reshape(-1, nd.numel())).view(*kd, *nd)
    return torch.einsum(_EQS[eq][1], x, g)


_FLAT: dict[str, tuple[int, int] | None] = {}


def _flat(eq: str) -> tuple[int, int] | None:
    """``(len K, len N)`` where ``eq`` is ``PK,KN->PN`` (subscript strings, in that order,
    each non-empty but P): a product whose weight gradient is ``x(P, K)^T @ g(P, N)``."""
    if eq not in _FLAT:
        _FLAT[eq] = None
        ins, _, out = eq.replace(" ", "").partition("->")
        a, _, b = ins.partition(",")
        if "." not in eq and _equations(eq) is not None:
            for p in range(len(a)):
                k = a[p:]
                if out[:p] == a[:p] and b.startswith(k) and out[p:] == b[len(k):] and len(b) > len(k):
                    _FLAT[eq] = (len(k), len(b) - len(k))
                    break
    return _FLAT[eq]


class _Product(torch.autograd.Function):
    """``einsum(eq, x, w)`` whose backward gives ``x``'s gradient and files ``w``'s."""

    generate_vmap_rule = True  # inside a virtual mesh's vmap levels: the rule from its ops

    @staticmethod
    def forward(x, w, eq, sink, k):
        if eq == _MM:
            return torch.matmul(x, w)
        if eq == _LINEAR:
            return F.linear(x, w)
        return torch.einsum(eq, x, w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, eq, sink, k = inputs
        ctx.save_for_backward(x, w)
        ctx.eq, ctx.sink, ctx.k = eq, sink, k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            if ctx.eq == _MM:
                dx = torch.matmul(g, w.t())
            elif ctx.eq == _LINEAR:
                dx = torch.matmul(g, w)
            else:
                dx = torch.einsum(_EQS[ctx.eq][0], g, w)
        ctx.sink.add(ctx.k, ctx.eq, x, g)
        return dx, None, None, None, None


_EQS: dict[str, tuple[str, str] | None] = {}  # eq -> (dx_eq, dw_eq), or None where the rule fails


def _equations(eq: str) -> tuple[str, str] | None:
    """``(dx_eq, dw_eq)`` for ``y = einsum(eq, x, w)``, or None where the rule does not hold."""
    if eq not in _EQS:
        _EQS[eq] = _derive(eq)
    return _EQS[eq]


def _derive(eq: str) -> tuple[str, str] | None:
    eq = eq.replace(" ", "")
    if "->" not in eq:
        return None
    ins, out = eq.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if "." in b or a.count("...") > 1 or ("..." in a) != ("..." in out):
        return None
    la, lb, lo = (s.replace("...", "") for s in (a, b, out))
    if any(len(set(s)) != len(s) for s in (la, lb, lo)):
        return None
    if not (set(la) <= set(lb) | set(lo) and set(lb) <= set(la) | set(lo) and set(lo) <= set(la) | set(lb)):
        return None
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


class Deferring(TorchFunctionMode):
    """Run a stage's forward with the weight gradients of ``params`` (the stage's leaves)
    filed with ``sink`` (a ``Deferred``) instead of computed in backward."""

    def __init__(self, params: list[torch.Tensor], sink: Deferred) -> None:
        super().__init__()
        self.ids = {id(p): k for k, p in enumerate(params)}
        self.sink = sink

    def _leaf(self, w: Any) -> int | None:
        return self.ids.get(id(w)) if isinstance(w, torch.Tensor) and w.requires_grad else None

    def _product(self, eq: str, x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor | None:
        if _equations(eq) is None or not torch.is_grad_enabled() or x.is_complex() or w.is_complex():
            return None  # (complex: the gradient takes the conjugate)
        return _Product.apply(x, w, eq, self.sink, k)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if func in _MATMUL and len(args) == 2 and not kwargs:
            x, w = args
            k = self._leaf(w)
            if k is not None and w.dim() == 2 and isinstance(x, torch.Tensor) and x.dim() >= 2:
                out = self._product(_MM, x, w, k)
        elif func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            k = self._leaf(w)
            if k is not None and w.dim() == 2 and x.dim() >= 2:
                out = self._product(_LINEAR, x, w, k)
                if out is not None and b is not None:
                    out = out + b
        elif func is torch.einsum and len(args) == 3 and isinstance(args[0], str) and not kwargs:
            eq, x, w = args
            k = self._leaf(w)
            if k is not None and isinstance(x, torch.Tensor) and self._leaf(x) is None:
                out = self._product(eq, x, w, k)
        if out is None:
            return func(*args, **kwargs)
        return out


# -- reading the graph (plain autograd) ------------------------------------------------------

# Nodes that only move or relabel elements (no saved tensors): run back to the parameter.
_VIEWS = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "PermuteBackward0", "TransposeBackward0",
    "TBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "ExpandBackward0", "CloneBackward0", "ToCopyBackward0", "AliasBackward0",
})
# product node -> the names of its saved operands, in its inputs' order
_PRODUCTS = {"MmBackward0": ("_saved_self", "_saved_mat2"), "BmmBackward0": ("_saved_self", "_saved_mat2"),
             "AddmmBackward0": (None, "_saved_mat1", "_saved_mat2")}


class Product(NamedTuple):
    """A parameter's one use, a matrix product found in the graph: the product's ``node``,
    ``leaf`` (the parameter's index), ``side`` (0: the parameter reaches the product's
    left operand, 1: its right), ``other`` (the other operand, as the node saved it) and
    ``chain`` (the view-like nodes from the product to the parameter, product first)."""

    node: Any
    leaf: int
    side: int
    other: torch.Tensor
    chain: tuple
    version: int  # ``other``'s when the forward ran (autograd's own check of a saved tensor)

    def weight_grad(self, g: torch.Tensor) -> torch.Tensor:
        """The parameter's gradient given ``g``, the gradient at the product's output."""
        a = self.other
        if a._version != self.version:
            raise RuntimeError(
                "pipeline: an operand of a weight product put off for W was modified in place after the "
                "forward (as autograd refuses a saved tensor modified in place); do not write into a "
                "stage's activations between its forward and its W")
        d = a.transpose(-1, -2) @ g if self.side == 1 else g @ a.transpose(-1, -2)
        for node in self.chain:
            d = node(d)
            if isinstance(d, tuple):
                (d,) = (t for t in d if t is not None)
        return d


def find_products(roots: list, leaves: list[torch.Tensor | None]) -> list[Product]:
    """The products of ``leaves`` (autograd leaves of a graph run from the nodes ``roots``;
    None: not one to put off) that can be put off: a real leaf used once, by a
    ``mm``/``bmm``/``addmm`` (the product's scale 1) through view-like nodes each used
    once. Read right after the forward (the nodes' saved operands are freed when backward
    runs). A leaf with a gradient hook of its own is not put off (W runs no hooks; nor
    does it run one registered on a view of the parameter inside the stage)."""
    seen, todo, kids = set(roots), list(roots), []
    while todo:  # every node once; ``kids`` every edge, for the in-degrees
        for c, _ in todo.pop().next_functions:
            kids.append(c)
            if c is not None and c not in seen:
                seen.add(c)
                todo.append(c)
    uses = collections.Counter(kids)
    uses.update(roots)  # a root takes the gradient it is seeded with as well
    index = {id(x): k for k, x in enumerate(leaves) if x is not None and not x._backward_hooks}
    found = []
    for p in seen:
        saved = _PRODUCTS.get(type(p).__name__)
        if saved is None:
            continue
        for pos, (n, _) in enumerate(p.next_functions):
            side = pos - (len(saved) - 2)  # addmm's first input is the added term
            chain: list = []
            while side in (0, 1) and n is not None and uses[n] == 1:  # down to the parameter
                if type(n).__name__ == "AccumulateGrad":
                    k = index.get(id(n.variable))
                    other = getattr(p, saved[len(saved) - 2 + (1 - side)])
                    # (complex: autograd's product takes the conjugate; not put off)
                    if k is not None and isinstance(other, torch.Tensor) and not other.is_complex() \
                            and getattr(p, "_saved_alpha", 1) == 1:
                        found.append(Product(p, k, side, other, tuple(chain), other._version))
                    break
                nexts = [e for e, _ in n.next_functions if e is not None]
                if type(n).__name__ not in _VIEWS or len(nexts) != 1:
                    break
                chain.append(n)
                n = nexts[0]
    return found
