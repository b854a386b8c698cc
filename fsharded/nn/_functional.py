"""An ``nn.Module`` as a pure function of a parameter pytree, its blocks run through
``fsharded.parallel.run_block``.

>>> fm = fs.nn.functional(model)                  # nanoGPT: fm.blocks == "transformer.h"
>>> logits, _ = fm.apply(fm.params, idx, targets)  # == model(idx, targets)
>>> step = fs.train_step(lambda p, b: fm.apply(p, b["x"], b["y"])[1], fs.optim.adamw(3e-4),
...                      mesh=fs.Mesh({"data": 4}), blocks=fm.blocks,
...                      param_specs=fs.parallel.zero(3)(fs.P(), fm.params))
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch import nn

# The same swap of a module's tensors that torch.func.functional_call does, as a context:
# a block's forward must run on the weights its run_block call hands it without going
# through nn.Module.__call__ a second time (that would run its hooks twice).
from torch.nn.utils.stateless import _reparametrize_module

from fsharded import _tree
from fsharded.nn._blocks import find_blocks
from fsharded.nn._hf_attention import hf_attention
from fsharded.nn._names import collect
from fsharded.parallel import blocks as _blocks
from fsharded.step._trainable import FROZEN_MARK

__all__ = ["FunctionalModule", "functional"]


def functional(module: nn.Module, *, blocks: str | bool | None = None) -> FunctionalModule:
    """``module`` as a pure function of its parameters: ``.params``, ``.buffers``,
    ``.apply(params, *args, **kwargs)``, ``.blocks``.

    ``blocks``: the dotted path of the ``nn.ModuleList`` of repeated blocks (given), None
    to find it (nanoGPT / GPT-2 ``transformer.h``, Llama / Mistral / Qwen2
    ``model.layers``, ..., else the largest ModuleList whose children are all one class;
    ``.blocks_origin`` says how), or False for none. Each block's forward then runs
    through ``fs.parallel.run_block``, where a ZeRO-3 step gathers that block's weights.
    """
    return FunctionalModule(module, blocks=blocks)


class FunctionalModule:
    """A module's parameters as a pytree and its forward as a function of them.

    ``params``: nested dicts by submodule name, lists for ``ModuleList`` / ``Sequential``
    children; a leaf's dotted path is its name in ``named_parameters()``. ``trainable``:
    the same tree of the parameters' ``requires_grad`` flags (a frozen backbone, a LoRA
    model's base weights: False); ``train_step`` reads them from ``params`` by default and
    takes the tree as ``trainable=`` for a copy of ``params`` (cast, moved), which loses them. Tied weights
    (nanoGPT's ``lm_head.weight is transformer.wte.weight``) are one leaf at the first
    name, ``tied`` maps the other names to it, and ``apply`` passes the leaf under every
    name, so the gradient of the leaf is the sum over its uses. The leaves are the
    module's parameters detached: the same storage, no copy and no autograd history
    (``train_step(...).init`` copies them; training changes the module only through
    ``load_into``). ``buffers``: the module's buffers (rotary ``inv_freq``, a causal mask)
    as a tree of the same kind; ``apply`` passes them to the module as constants, on the
    device of the parameters it is given (meta for a step's dry runs). They are not
    trained and must not be updated in place under the virtual mesh (vmap).

    ``apply(params, *args, **kwargs)`` is ``module(*args, **kwargs)`` run on ``params``
    (``torch.func.functional_call``), under plain autograd, ``torch.func.grad`` and
    ``vmap``. With ``blocks`` set, block ``i`` runs as ``run_block(fn, params[blocks][i],
    x, **tensors)``: ``x`` its first argument, ``tensors`` those of its other arguments
    (by parameter name) that hold tensors (a mask, rotary ``position_embeddings``, integer
    ``position_ids``), which the step's handler takes as inputs (a ZeRO-3 remat
    differentiates only the floating ones that need a gradient); the others (``None``,
    caches, flags) are constants ``fn`` keeps. ``fn(full_block_params, x, **tensors)``
    runs the block's forward on the weights it receives. A block that returns a tuple
    hands ``run_block`` its first element and gets the rest back unchanged. While
    ``apply`` runs, the block modules'
    ``forward`` is replaced (restored on exit): do not run the same module from
    another thread meanwhile.

    A Hugging Face model with its default SDPA attention runs it, while ``apply`` runs
    (and when a ZeRO-3 remat re-runs a block), as fsharded's flash attention registered
    with ``AttentionInterface`` (``fsharded/nn/_hf_attention.py``): SDPA's numbers without
    torch's per-sample fallback under vmap; padding masks, attention dropout (drawing from
    the step's keys) and ``output_attentions`` are handled. Its config reads ``"sdpa"``
    again on exit: the module itself is not changed.
    """

    def __init__(self, module: nn.Module, *, blocks: str | bool | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"fs.nn.functional: expected an nn.Module, got {type(module).__name__}")
        self.module = module
        named = collect(module, "parameters")
        self.params = named.tree
        self.tied: dict[str, str] = dict(named.aliases)
        self._param_paths, leaves, self._param_def = _tree.tree_flatten_with_paths(self.params)
        # The module's requires_grad flags: a frozen parameter's leaf is marked, so that
        # train_step (trainable= by default) neither differentiates nor updates it.
        flags = [bool(named.tensors[p].requires_grad) for p in self._param_paths]
        for x, f in zip(leaves, flags):
            if not f:
                setattr(x, FROZEN_MARK, True)
        self.trainable = optree.tree_unflatten(self._param_def, flags)
        bufs = collect(module, "buffers")
        self.buffers = bufs.tree
        self._buffer_paths = _tree.tree_flatten_with_paths(self.buffers)[0]
        self._buffer_aliases = dict(bufs.aliases)
        self._moved: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.blocks, self.blocks_origin = find_blocks(module, blocks)
        self._attention = hf_attention(module)
        self._block_info = self._plan_blocks() if self.blocks is not None else []

    # -- blocks --------------------------------------------------------------------------

    def _plan_blocks(self) -> list[dict]:
        """Per block: its module, and the names its forward needs (local to the block)."""
        path = self.blocks
        mods = list(self.module.get_submodule(path))
        sub = _tree.get_path(self.params, path) if self._has(path) else None
        if not isinstance(sub, list) or len(sub) != len(mods):
            raise ValueError(
                f"fs.nn.functional(blocks={path!r}): the parameters under {path!r} are not one "
                f"subtree per block ({len(mods)} blocks); pass blocks=False"
            )
        bad = [f"  {a} is {c}" for a, c in self.tied.items() if _block_of(a, path) != _block_of(c, path)]
        if len({id(m) for m in mods}) != len(mods):
            bad.append(f"  the same module object appears more than once in {path!r}")
        if bad:
            raise ValueError(
                f"fs.nn.functional(blocks={path!r}): parameters are shared across the block "
                f"boundary:\n" + "\n".join(bad) + "\nA block's weights must be its own for "
                "per-block gathering (ZeRO-3): untie them, or pass blocks=False"
            )
        info = []
        for i, (mod, p) in enumerate(zip(mods, sub)):
            prefix = f"{path}.{i}."
            info.append({
                "module": mod,
                "paths": _tree.tree_flatten_with_paths(p)[0],  # in the leaf order of p
                "aliases": {a[len(prefix):]: c[len(prefix):] for a, c in self.tied.items()
                            if a.startswith(prefix)},
                "buffers": [n for n in [*self._buffer_paths, *self._buffer_aliases]
                            if n.startswith(prefix)],
                "prefix": prefix,
            })
        return info

    def _has(self, path: str) -> bool:
        try:
            _tree.get_path(self.params, path)
        except KeyError:
            return False
        return True

    def _attending(self, name: str | None) -> contextlib.AbstractContextManager:
        """A Hugging Face model's SDPA layers run as ``name`` (fsharded's attention, or
        eager for attention weights) while entered; other modules are untouched."""
        return self._attention.uses(name) if self._attention is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _routing(self, params: Any, buffers: dict[str, torch.Tensor], attention: str | None) -> Iterator[None]:
        if self.blocks is None:
            yield
            return
        subs = _tree.get_path(params, self.blocks)
        saved = []
        try:
            for info, sub in zip(self._block_info, subs):
                mod = info["module"]
                saved.append((mod, mod.__dict__.get("forward", _NOTHING)))
                # An instance attribute shadows the class's forward for nn.Module.__call__.
                mod.__dict__["forward"] = self._routed(info, mod.forward, sub, buffers, attention)
            yield
        finally:
            for mod, old in reversed(saved):
                if old is _NOTHING:
                    mod.__dict__.pop("forward", None)
                else:
                    mod.__dict__["forward"] = old

    def _routed(self, info: dict, forward: Callable, sub: Any, buffers: dict[str, torch.Tensor],
                attention: str | None) -> Callable:
        """A block's forward for the duration of one ``apply``: through ``run_block`` with
        ``sub``, its subtree of the parameters ``apply`` was given, and with the attention
        ``apply`` chose (a remat runs it again in backward, after ``apply`` has returned)."""
        prefix = info["prefix"]
        local_buffers = {n[len(prefix):]: buffers[n] for n in info["buffers"]}

        def routed(*args: Any, **kwargs: Any) -> Any:
            x, rest, moving, fixed = _arguments(forward, args, kwargs, prefix[:-1])
            if _blocks.active():
                # A step that may run the block again (ZeRO-3's re-gather, a remat): a
                # key/value cache would be extended twice (the recomputation attending over
                # doubled keys), so no cache, as HF does under gradient checkpointing.
                fixed = {k: (None if k in _CACHE_ARGS else False if k == "use_cache" else v)
                         for k, v in fixed.items()}
            tail: list = []

            def fn(full: Any, h: Any, *a: Any, **kw: Any) -> Any:
                leaves = optree.tree_leaves(full)
                if len(leaves) != len(info["paths"]):
                    raise ValueError(
                        f"fs.nn: block {prefix[:-1]} got {len(leaves)} parameter leaves, its "
                        f"module has {len(info['paths'])} ({info['paths'][:4]}...)")
                local = dict(zip(info["paths"], leaves))
                local.update((a_, local[c]) for a_, c in info["aliases"].items())
                local.update(local_buffers)
                with _reparametrize_module(info["module"], local), self._attending(attention):
                    out = forward(h, *a, **fixed, **kw)
                if type(out) is tuple and out and isinstance(out[0], torch.Tensor):
                    if not tail:  # a recomputation in backward gives the same rest
                        tail.append(out[1:])
                    return out[0]
                return out

            y = _blocks.run_block(fn, sub, x, *rest, **moving)
            return (y, *tail[0]) if tail else y

        return routed

    # -- apply ---------------------------------------------------------------------------

    def apply(self, params: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` with its parameters taken from ``params`` (a tree
        laid out like ``self.params``)."""
        leaves, treedef = optree.tree_flatten(params)
        if treedef != self._param_def:
            raise ValueError(self._mismatch(params))
        flat = dict(zip(self._param_paths, leaves))
        flat.update((a, flat[c]) for a, c in self.tied.items())
        device = leaves[0].device if leaves else None
        buffers = self._buffers_on(device)
        flat.update(buffers)
        attention = self._attention.choose(kwargs) if self._attention is not None else None
        with self._attending(attention), self._routing(params, buffers, attention), _meta_autocast(device):
            return torch.func.functional_call(self.module, flat, args, kwargs, tie_weights=False)

    def _buffers_on(self, device: torch.device | None) -> dict[str, torch.Tensor]:
        """Every buffer name (aliases too) -> the buffer, moved to ``device`` once."""
        leaves = optree.tree_leaves(self.buffers)
        if len(leaves) != len(self._buffer_paths):
            raise ValueError(
                f"fs.nn: .buffers was changed to {len(leaves)} leaves; the module has "
                f"{len(self._buffer_paths)} ({self._buffer_paths}); replace leaves, keep the tree")
        out = {}
        for name, b in zip(self._buffer_paths, leaves):
            if device is not None and b.device != device:
                key = (id(b), str(device))
                hit = self._moved.get(key)
                if hit is None or hit[0] is not b:
                    hit = self._moved[key] = (b, b.to(device))
                b = hit[1]
            out[name] = b
        out.update((a, out[c]) for a, c in self._buffer_aliases.items())
        return out

    def _mismatch(self, params: Any) -> str:
        head = (f"fs.nn: apply(params) of {type(self.module).__name__} got a tree not laid out "
                f"like its .params")
        try:
            paths = _tree.tree_flatten_with_paths(params)[0]
        except Exception:  # noqa: BLE001 - not a pytree at all
            return f"{head}: got a {type(params).__name__}"
        want = set(self._param_paths)
        missing = [p for p in self._param_paths if p not in set(paths)]
        unexpected = [p for p in paths if p not in want]
        lines = [f"  missing: {p}" for p in missing]
        lines += [f"  unexpected: {p}" + (f" (tied to {self.tied[p]}: stored once, at {self.tied[p]})"
                                          if p in self.tied else "") for p in unexpected]
        if not lines:
            lines = ["  the same names in another structure (a flat {name: tensor} dict, tuples "
                     "for lists?); build it like fm.params, e.g. fs.tree_map_with_path over it"]
        return head + ":\n" + "\n".join(lines[:16]) + ("\n  ..." if len(lines) > 16 else "")

    def __repr__(self) -> str:
        n = sum(x.numel() for x in optree.tree_leaves(self.params))
        tied = ", ".join(f"{a} -> {c}" for a, c in self.tied.items()) or "none"
        return (f"FunctionalModule({type(self.module).__name__}: {len(self._param_paths)} leaves, "
                f"{n:,} parameters; tied: {tied}; buffers: {self._buffer_paths or 'none'}; "
                f"blocks: {self.blocks!r}, {self.blocks_origin})")


_NOTHING = object()


def _block_of(name: str, path: str) -> str | None:
    """The block index ``name`` lies in under the block list ``path``, or None outside."""
    if not name.startswith(path + "."):
        return None
    return name[len(path) + 1:].split(".", 1)[0]


_CACHE_ARGS = frozenset({"past_key_values", "past_key_value", "layer_past"})


def _arguments(forward: Callable, args: tuple, kwargs: dict, block: str) -> tuple:
    """``(x, rest, moving, fixed)`` of one block call: its input ``x``; the arguments that
    hold floating-point tensors (``moving``, by name: a mask, rotary tables, a residual
    stream from outside the block), passed through ``run_block`` so that a ZeRO-3 gather
    or a remat takes them as inputs (a tensor made inside the differentiated loss and
    captured by a remat instead breaks functorch, and one that needs a gradient would
    lose it); the others (``fixed``: integer positions, ``None``, caches, flags),
    constants ``fn`` keeps. Positional arguments after ``x`` are given their parameter
    names; a forward they cannot be named for (``*args``, positional-only) gets them
    positionally (``rest``)."""
    try:
        sig = inspect.signature(forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        sig = bound = None
    named: dict | None = None
    if bound is not None and bound.arguments:
        named = {}
        for name, value in bound.arguments.items():
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL or kind is inspect.Parameter.POSITIONAL_ONLY:
                named = None
                break
            else:
                named[name] = value
    if named is not None and next(iter(sig.parameters)) in named:
        x = named.pop(next(iter(sig.parameters)))
        rest: tuple = ()
    elif args:
        x, rest, named = args[0], args[1:], dict(kwargs)
    else:
        raise TypeError(f"fs.nn: block {block} was called without an input (its forward's first "
                        f"argument)")
    moving = {k: v for k, v in named.items() if _floating(v)}
    fixed = {k: v for k, v in named.items() if k not in moving}
    return x, rest, moving, fixed


def _floating(v: Any) -> bool:
    """Whether ``v`` holds a tensor: such arguments travel as the block's inputs (captured
    by a remat instead, a tensor made inside the differentiated loss breaks functorch)."""
    return any(isinstance(t, torch.Tensor) for t in optree.tree_leaves(v))


@contextlib.contextmanager
def _meta_autocast(device: torch.device | None) -> Iterator[None]:
    """Let ``torch.autocast("meta", enabled=False)`` be a no-op while a module runs on meta
    tensors (a step's dry run). Hugging Face rotary embeddings open that context to force
    fp32; torch 2.13 has no autocast for meta and raises. Other devices are untouched."""
    if device is None or device.type != "meta":
        yield
        return
    original = torch.autocast

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        enabled = kwargs.get("enabled", args[1] if len(args) > 1 else True)
        if device_type == "meta" and not enabled:
            return contextlib.nullcontext()
        return original(device_type, *args, **kwargs)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = original
