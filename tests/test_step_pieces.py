"""The gradient side of train_step piece by piece: the reduction each leaf's specs imply,
each gradient strategy (plain, accumulated, ZeRO-3 gathered per block) against
torch.func.grad of the whole model, on the virtual mesh and on 2 gloo ranks; and that
nothing outside ``fsharded/parallel/zero.py`` branches on a ZeRO stage number."""

from __future__ import annotations

import ast
import pathlib

import pytest
import step_pieces_cases as C
import torch

import fsharded as fs
from fsharded.step._layout import Moves

# float64 throughout: only the order of summation differs from the references.
TOL = dict(rtol=1e-12, atol=1e-12)
MESH = fs.Mesh({"data": 2})


def _check_reduction(got: dict) -> None:
    want = C.reduction_case()["mean"]
    assert sorted(got) == sorted(want)  # the frozen leaf has no gradient
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)


def _check_strategy(res: dict) -> None:
    params, batch = C.model()
    want, loss = C.reference(params, batch)
    paths, leaves, _ = fs._tree.tree_flatten_with_paths(want)
    flat = dict(zip(paths, leaves))
    assert sorted(res["grads"]) == sorted(p for p in flat if C.TRAINS(p))
    for p, g in res["grads"].items():
        torch.testing.assert_close(g, flat[p], **TOL, msg=p)
    torch.testing.assert_close(res["loss"], loss.float())  # the step reports the loss in fp32


def test_moves_read_off_the_specs():
    """Each leaf's movement follows from its specs alone (the stage field says 0)."""
    mv = Moves.of(C.reduction_placement())
    order = sorted(C.R_SHAPES)  # frozen, rep, z1, z2, z3
    assert mv.axis == "data"
    assert dict(zip(order, mv.gather_in_loss)) == {"frozen": False, "rep": False, "z1": False, "z2": False,
                                                   "z3": True}
    assert dict(zip(order, mv.scatter)) == {k: k == "z2" for k in order}
    assert dict(zip(order, mv.slice)) == {k: k == "z1" for k in order}
    assert dict(zip(order, mv.gather_before)) == {k: k in ("z1", "z2") for k in order}
    plain = Moves.of(fs.parallel.Placement.replicated({"w": fs.P()}))
    assert plain.axis is None and not any(plain.gather_in_loss + plain.gather_before + plain.scatter)


def test_reduction_of_a_mixed_tree_virtual():
    _check_reduction(C.run_reduction(MESH, C.reduction_case()))


@pytest.mark.parametrize("case", list(C.STRATEGIES))
def test_strategy_equals_the_whole_model_virtual(case):
    _check_strategy(C.run_strategy(case, MESH))


@pytest.mark.filterwarnings("ignore:zero.3, axis='data'.. the axis has size 1")
@pytest.mark.parametrize("kind", ["plain", "blocks"])
def test_strategy_on_one_device_eager(kind):
    """A one-device mesh: plain autograd (the eager differentiator) on the whole batch."""
    _check_strategy(C.run_strategy(kind, fs.Mesh({"data": 1}), eager=True))


@pytest.mark.multiprocess
def test_reduction_and_strategies_on_two_gloo_ranks():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(C.on_gloo, 2, 2):
        _check_reduction(res["reduction"])
        for case in C.STRATEGIES:
            _check_strategy(res[case])
        assert res["plain-zero2"]["in_backward"] and not res["plain"]["in_backward"]


@pytest.mark.multiprocess
def test_in_backward_reduction_zeroes_the_leaves_without_gradient():
    """Reduced inside backward on gloo ranks, with buckets of uninitialised (nan) memory: a
    leaf no hook filled comes back zero, beside the ranks' mean of the others (all-reduced
    and reduce-scattered buckets)."""
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(C.in_backward_unused, 2, 2):
        for k, want in res["expect"].items():
            torch.testing.assert_close(res["got"][k], want, rtol=1e-12, atol=0, msg=k)


# -- no stage number outside zero.py -----------------------------------------------------------

ROOT = pathlib.Path(fs.__file__).parent


def stage_reads(source: str) -> list[int]:
    """Lines of ``source`` that read an attribute named ``stage`` (``pl.stage``,
    ``getattr(pl, "stage")``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "stage":
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "stage"):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_finds_a_stage_read():
    assert stage_reads("if pl.stage == 3:\n    pass\nx = getattr(p, 'stage', 0)\n") == [1, 3]
    assert stage_reads("stage = 3\nzero(stage)\n") == []


def test_no_zero_stage_read_outside_zero_py():
    """The step (and the other strategies in ``parallel``) decide from the spec trees;
    only ``parallel/zero.py`` turns a stage into specs (and names it in messages). The
    pipeline's tables name pipeline stages (``Action.stage``), which are another thing."""
    files = sorted((ROOT / "step").rglob("*.py")) + sorted(
        f for f in (ROOT / "parallel").rglob("*.py") if "pipeline" not in f.relative_to(ROOT).parts)
    bad = [f"{f.relative_to(ROOT)}:{n}" for f in files if f.name != "zero.py"
           for n in stage_reads(f.read_text())]
    assert not bad, f"ZeRO stage read outside fsharded/parallel/zero.py: {bad}"


def test_train_step_with_a_mixed_placement_equals_one_device():
    """The pieces composed by train_step: a placement mixing every movement (and a frozen
    leaf) trains as the replicated model on one device does."""
    one = C.train_mixed({"data": 1}, mixed=False)
    two = C.train_mixed({"data": 2}, mixed=True)
    # The step reports its loss in fp32: equal to fp32 rounding.
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-6, atol=1e-6)
    for a, b in zip(fs._tree.tree_flatten_with_paths(two["params"])[1],
                    fs._tree.tree_flatten_with_paths(one["params"])[1]):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_virtual_bucket_reduction_beneath_the_levels_equals_the_vmapped_collective(n, dtype, monkeypatch):
    """On the virtual mesh a bucket of gradients that vary over a batch axis of 2 devices
    alone is averaged beneath the vmap levels (``_virtual.pmean_beneath``): the same bits as
    the vmapped pmean of the bucket, typed invariant, and the same manifest (one psum of
    the bucket's size). Over more devices (where the order of a sum's terms depends on the
    layout), or a bucket that also varies over another axis, the vmapped form runs."""
    from fsharded.parallel import _buckets as B
    from fsharded.spmd import _manifest, _virtual

    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 3, 4), (1,)]
    grads = [torch.randn(n * 2, *s, generator=g, dtype=dtype) for s in shapes]

    def run(mesh, specs, fast: bool):
        calls = []
        with monkeypatch.context() as m:
            real = _virtual.pmean_beneath
            m.setattr(_virtual, "pmean_beneath",
                      lambda xs, axes: calls.append(real(xs, axes) if fast else None) or calls[-1])

            def body(*gs):
                out = B.reduce_leaves(list(gs), [fs.P()] * len(gs), [fs.P()] * len(gs), ("data",), mesh,
                                      cap=10**9)
                return tuple(out)

            f = fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tuple(fs.P() for _ in grads))
            with _manifest.recording() as entries:
                out = f(*grads)
        return out, [(e.op, e.axis, e.shape) for e in entries], calls

    mesh = fs.Mesh({"data": n})
    specs = tuple(fs.P("data") for _ in grads)
    fast, m_fast, calls = run(mesh, specs, True)
    assert calls and all((c is not None) == (n == 2) for c in calls)  # the path under test ran where it applies
    slow, m_slow, _ = run(mesh, specs, False)
    assert m_fast == m_slow == [("psum", "data", (sum(torch.Size(s).numel() for s in shapes) * 2,))]
    for a, b, x in zip(fast, slow, grads):
        assert torch.equal(a, b)
        want = torch.stack(list(x.reshape(n, 2, *x.shape[1:]).unbind(0))).sum(0) / n
        torch.testing.assert_close(a, want)
    # data x tensor, gradients that also vary over tensor: beneath does not apply
    mesh2 = fs.Mesh({"data": 2, "tensor": 2})
    g2 = [torch.randn(2, 4, *s, generator=g, dtype=dtype) for s in shapes]
    specs2 = tuple(fs.P("data", "tensor") for _ in g2)

    def body2(*gs):
        return tuple(B.reduce_leaves(list(gs), [fs.P(None, "tensor")] * len(gs), [fs.P(None, "tensor")] * len(gs),
                                     ("data",), mesh2, cap=10**9))

    calls2 = []
    with monkeypatch.context() as m:
        real = _virtual.pmean_beneath
        m.setattr(_virtual, "pmean_beneath", lambda xs, axes: calls2.append(real(xs, axes)) or calls2[-1])
        out2 = fs.shard_map(body2, mesh=mesh2, in_specs=specs2,
                            out_specs=tuple(fs.P(None, "tensor") for _ in g2))(*g2)
    assert calls2 == [None]
    for a, x in zip(out2, g2):
        torch.testing.assert_close(a, x.reshape(2, 1, 4, *x.shape[2:]).mean(0).reshape(1, 4, *x.shape[2:]))


def test_scatter_leaves_is_the_transpose_of_gather_leaves():
    """``_buckets.scatter_leaves`` (the reduce-scatter an asynchronous ZeRO-3 gather runs by
    hand) gives what the gather's own vjp gives, in small buckets and large, for leaves
    sharded on dim 0, on an inner dim, and not at all."""
    from fsharded.parallel import _buckets as B

    mesh = fs.Mesh({"data": 2})
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (3, 6), (5,), (2, 2)]
    src = [fs.P("data"), fs.P(None, "data"), fs.P(), fs.P("data")]
    dst = [fs.P(), fs.P(), fs.P(), fs.P()]
    shards = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    cots = [torch.randn(2, *s, generator=g, dtype=torch.float64) for s in shapes]  # per device

    for cap in (5, 10**6):
        def body(*xs_and_gs, cap=cap):
            xs, gs = list(xs_and_gs[:4]), list(xs_and_gs[4:])
            _, vjp = torch.func.vjp(lambda ys: B.gather_leaves(list(ys), src, dst, "data", mesh, cap), xs)
            (want,) = vjp(gs)
            got = B.scatter_leaves(gs, src, dst, "data", mesh, cap)
            return tuple(want) + tuple(got)

        in_specs = tuple(src) + tuple(fs.P("data") for _ in cots)
        flat_cots = [c.reshape(-1, *c.shape[2:]) for c in cots]
        out = fs.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tuple(src) * 2,
                           check_vma=False)(*shards, *flat_cots)
        for a, b in zip(out[:4], out[4:]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
