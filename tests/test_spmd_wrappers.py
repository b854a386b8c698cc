"""``spmd._wrappers``: the one place above which torch.func's wrappers are asked about, each
question against the values vmap, grad and a plain call give; and no module outside spmd
probes torch.func's internals itself (but the memory hooks, which sit below spmd)."""

from __future__ import annotations

import pathlib

import torch

from fsharded.spmd import _wrappers as W


def test_plain_and_wrapped():
    x = torch.ones(3, 2)
    assert W.plain({"a": x, "b": None, "c": 1.0}) and not W.is_wrapped(x)
    assert torch.func.vmap(lambda t: torch.tensor(W.plain((t, x))))(x).tolist() == [False] * 3
    assert torch.func.vmap(lambda t: torch.tensor(W.plain(x)))(x).tolist() == [True] * 3  # not batched here

    def under_grad(t):
        assert W.is_wrapped(t)
        return t.sum()

    torch.func.grad(under_grad)(torch.ones(2))


def test_transforms_active():
    assert not W.transforms_active()
    assert bool(torch.func.vmap(lambda t: torch.tensor(W.transforms_active()))(torch.ones(2)).all())


def test_requires_grad_through_vmap():
    w = torch.ones(3, 2, requires_grad=True)
    seen = []

    def f(t):
        seen.append((t.requires_grad, W.requires_grad(t)))
        return t * 2

    torch.func.vmap(f)(w)
    assert seen == [(False, True)]  # the wrapper says False, the tensor beneath is tracked
    assert not W.requires_grad(torch.ones(2)) and W.requires_grad(w)


def test_readable_beneath_grad():
    x = torch.arange(3.0)
    assert W.readable_beneath_grad(x) is x
    got = []

    def f(t):
        got.append(W.readable_beneath_grad(t))
        return t.sum()

    torch.func.grad(f)(x)
    assert got[0] is not None and not W.is_wrapped(got[0]) and got[0].tolist() == [0.0, 1.0, 2.0]
    torch.func.vmap(lambda t: got.append(W.readable_beneath_grad(t)) or t)(x)
    assert got[1] is None  # each batch element is another value


def test_no_functorch_probes_outside_spmd():
    root = pathlib.Path(__file__).resolve().parents[1] / "fsharded"
    probing = sorted(str(f.relative_to(root)) for f in root.rglob("*.py")
                     if "_functorch" in f.read_text() and f.parent.name != "spmd")
    # The memory hooks sit below spmd (spmd calls them) and find a storage beneath whatever
    # wraps it: a value batched on the virtual mesh, grad-tracked under remat, or plain.
    assert probing == ["_memory_hooks.py"]
