"""Compiled against eager steps (``train_step(compile=True)``), shared by the compile tests."""

from __future__ import annotations

import contextlib
import functools
import io

import optree
import torch
import torch.nn.functional as F
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.comm import _graph_ops
from fsharded.models import gpt

STEPS = 5


def gpt_step(compile: bool, *, mesh=None, stage=None, precision="fp32", accumulation=1, remat=None,  # noqa: A002
             blocks=None, config=T.CONFIG, optimizer=None, zero_kw=None, **kw):
    params = gpt.init(config, 0)
    specs = fs.parallel.zero(stage, min_size=16, **(zero_kw or {}))(P(), params) if stage is not None else P()
    opt = optimizer if optimizer is not None else fs.optim.adamw(T.LR, weight_decay=T.WD)
    step = fs.train_step(gpt.loss, opt, mesh=fs.Mesh(mesh or {"data": 1}), param_specs=specs,
                         precision=precision, accumulation=accumulation, clip=T.CLIP, remat=remat, blocks=blocks,
                         compile=compile, **kw)
    return step, params


def hf_gpt2_step(compile: bool, *, dropout: float = 0.1, seed: int | None = 0):  # noqa: A002
    """A Hugging Face GPT-2 built from a config, in train mode with dropout, through
    ``fs.nn.functional``: its dropout draws from the step's key."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    torch.manual_seed(0)
    fm = fs.nn.functional(transformers.GPT2LMHeadModel(cfg).train())

    def loss(p, b):
        return F.cross_entropy(fm.apply(p, input_ids=b["tokens"][:, :-1]).logits.flatten(0, 1),
                               b["tokens"][:, 1:].flatten())

    step = fs.train_step(loss, fs.optim.adamw(1e-3), clip=1.0, seed=seed, compile=compile)
    return step, fm.params


def train(step, params, batches) -> dict:
    state = step.init(params)
    losses, norms, compile_s, skipped, scales = [], [], [], [], []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        skipped.append(int(m["skipped"]))
        scales.append(float(m["loss_scale"]))
        compile_s.append(float(m["compile_s"]) if "compile_s" in m else None)
    return {"losses": losses, "norms": norms, "params": optree.tree_leaves(step.params(state)),
            "compile_s": compile_s, "skipped": skipped, "scales": scales, "state": state}


def close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a["skipped"] == b["skipped"] and a["scales"] == b["scales"], (a["skipped"], b["skipped"])
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=tol, atol=tol)
    # An overflowing fp16 step's norm is inf or nan (which one depends on the order of the
    # sum): the same steps non-finite, the same values where finite.
    na, nb = torch.tensor(a["norms"]), torch.tensor(b["norms"])
    assert torch.equal(na.isfinite(), nb.isfinite()), (a["norms"], b["norms"])
    torch.testing.assert_close(na[na.isfinite()], nb[nb.isfinite()], rtol=tol, atol=tol)
    for x, y in zip(a["params"], b["params"]):
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol)


def both(make, batches, tol: float = 1e-5, backend: str | bool = True) -> tuple[dict, dict]:
    """The same training compiled (with ``backend``) and eager; asserts they agree within
    ``tol`` and that one graph was captured."""
    eager = train(*make(False), batches)
    step, params = make(backend)
    got = train(step, params, batches)
    close(got, eager, tol)
    assert step.compiles == 1
    return got, eager


def gloo_compiled(world: int) -> dict:
    """On each rank: three steps of the GPT at ZeRO 0-3 eager and through the captured
    graph (functional collectives in it), their losses, norms and final parameters."""
    out = {}
    for stage in (0, 1, 2, 3):
        runs = {}
        for compile_ in (False, "eager"):
            step, params = gpt_step(compile_, mesh={"data": world}, stage=stage, blocks="blocks" if stage == 3 else None)
            r = train(step, params, T.batches(3))
            runs[bool(compile_)] = {k: r[k] for k in ("losses", "norms", "params", "skipped", "scales", "compile_s")}
            runs[bool(compile_)]["compiles"] = step.compiles
        out[stage] = runs
        out[stage]["transports"] = _graph_ops.kinds(step.graph(r["state"], T.batches(1)[0]))
    return out


def gloo_mixed_transports(world: int) -> dict:
    """On each rank: a ZeRO-2 step captured where the first collective traced would go
    over shared memory and the others over torch's functional ops: the capture is traced
    again with the functional ops only; its graph's transports and its numbers."""
    from unittest import mock

    real = _graph_ops.uses_shm
    calls = [0]

    def first_only(g, dtype):
        calls[0] += 1
        return calls[0] == 1 and real(g, dtype)

    runs = {}
    for compile_ in (False, "eager"):
        step, params = gpt_step(compile_, mesh={"data": world}, stage=2)
        with mock.patch.object(_graph_ops, "uses_shm", first_only):
            r = train(step, params, T.batches(3))
            transports = _graph_ops.kinds(step.graph(r["state"], T.batches(1)[0])) if compile_ else set()
        runs[bool(compile_)] = {k: r[k] for k in ("losses", "norms", "params", "skipped", "scales")}
    return {"runs": runs, "transports": transports, "calls": calls[0]}


def gloo_pipelines(world: int) -> dict:
    """On each of 4 ranks (data=2 x pipe=2): pipelined steps eagerly and through the
    captured graph (the stages' values sent and received as ops of it): zero-bubble
    with ZeRO-3 regathering per block, and 1F1B in fp16 from a loss scale that overflows
    (skipped steps); each run's losses, scales, skips and parameters."""
    import pipeline_cases as PC

    mesh = {"data": 2, "pipe": 2}
    out = {}
    for compile_ in (False, "eager"):
        zb = PC.train(mesh, "zb", 1, 3, m=2, zero=3, reshard=True, compile=compile_)
        fp16 = PC.train_mixed(mesh, "1f1b", 5, "fp16", power=21, tied_embeddings=False, compile=compile_)
        out[bool(compile_)] = {"zb": {k: zb[k] for k in ("losses", "norms", "params", "compiles")}, "fp16": fp16}
    return out


def gloo_pipeline_functional(world: int) -> str:
    """On each rank: the error of a compiled pipelined step whose other collectives would
    run over torch's functional ops (not shared memory)."""
    from unittest import mock

    import pipeline_cases as PC

    with mock.patch.object(_graph_ops, "uses_shm", lambda g, dtype: False):
        try:
            PC.train({"data": 1, "pipe": world}, "1f1b", 1, 1, compile="eager")
        except NotImplementedError as e:
            return str(e)
    return ""


# fsharded train's layouts over other axes than the batch's, on 2 real ranks, with the
# torch.compile backend each runs the captured graph through (Inductor for the pipeline,
# whose graphs differ between ranks and whose sends and receives Inductor must keep in
# order with the collectives, without letting a send read a buffer it reuses; the traced
# ring exchange is checked bit for bit against eager by gloo_traced_permute).
GLOO_LAYOUTS = {
    "tensor=2": (["--mesh", "data=1,tensor=2"], "eager"),
    "Ulysses, seq=2": (["--mesh", "data=1,seq=2"], "eager"),
    "ring attention, seq=2": (["--mesh", "data=1,seq=2", "--set", "model.seq_parallel=ring"], "eager"),
    "experts, expert=2": (["--mesh", "data=1,expert=2", "--set", "model.moe.experts=4"], "eager"),
    "pipeline 1F1B, pipe=2": (["--mesh", "data=1,pipe=2", "--accum", "2"], "inductor"),
}


def gloo_layouts(world: int, steps: int = 5, names: list | None = None) -> dict:
    """On each rank: each of ``GLOO_LAYOUTS`` trained ``steps`` steps eagerly and compiled,
    every step's loss (from the metrics file: rank 0's), the final validation loss and the
    compile time of each."""
    import json
    import tempfile
    from pathlib import Path
    from unittest import mock

    from fsharded import train
    from fsharded.step import _compile

    init = _compile.Captured.__init__
    out = {}
    for name, (mesh, backend) in GLOO_LAYOUTS.items():
        if names is not None and name not in names:
            continue
        runs = {}
        for compiled in (False, True):
            with tempfile.TemporaryDirectory() as d:
                args = ["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", str(steps), "--set",
                        "data=stdlib:200000", "--progress", "off", "--metrics", str(Path(d) / "m.jsonl"), *mesh]
                cfg = train.make_config(train.build_parser().parse_args(args + (["--compile"] if compiled else [])))
                with mock.patch.object(_compile.Captured, "__init__",
                                       lambda self, fn, b=backend, **kw: init(self, fn, **{**kw, "backend": b})), \
                        contextlib.redirect_stdout(io.StringIO()):
                    summary = train.run(cfg, progress="off")
                written = Path(d) / "m.jsonl"  # (rank 0 writes the metrics)
                recs = [json.loads(x) for x in written.read_text().splitlines()] if written.exists() else []
            runs[compiled] = {"losses": [r["loss"] for r in recs if "loss" in r], "val_loss": summary["val_loss"],
                              "compile_s": summary["compile_s"]}
        out[name] = runs
    return out


def gloo_eager_collective(world: int) -> str:
    """On each rank: the error of a compiled step whose loss calls torch.distributed's
    in-place all-reduce itself (the graph would lose it)."""
    import torch.distributed as dist

    def loss(p, b):
        y = (b["x"] @ p["w"]).sum()
        total = y.detach().clone()
        dist.all_reduce(total)  # (in place, outside the graph's values)
        return y / total

    step = fs.train_step(loss, fs.optim.sgd(0.1), mesh=fs.Mesh({"data": world}), compile="eager")
    try:
        step(step.init({"w": torch.ones(3, 2)}), {"x": torch.ones(4, 3)})
    except RuntimeError as e:
        return str(e)
    return ""


def _permute(t: torch.Tensor, *, g, perm) -> torch.Tensor:
    from fsharded import comm

    return comm.send_recv(t * 1.0, g, perm)


def gloo_traced_permute(world: int) -> dict:
    """On each rank: ``send_recv`` eagerly and as the graph ``make_fx`` traces of it (the
    collective that stands for it in a captured step: over shared memory, and torch's
    functional one), for a cycle, a shift
    that leaves position 0 receiving nothing, and a swap over a mesh axis whose positions
    are not the group's ranks' order."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fsharded import comm

    out = {}
    for name, mesh, axes, perm in (
            ("cycle", {"x": world}, ("x",), tuple((i, (i + 1) % world) for i in range(world))),
            ("shift", {"x": world}, ("x",), tuple((i, i + 1) for i in range(world - 1))),
            ("minor axis", {"a": world // 2, "b": 2}, ("b",), ((0, 1), (1, 0)))):
        g = comm.axis_group(fs.Mesh(mesh), axes)
        x = torch.arange(6.0).reshape(2, 3) + 10 * torch.distributed.get_rank()
        out[name] = {"eager": comm.send_recv(x, g, perm)}
        for transport, scope in (("shm", contextlib.nullcontext), ("functional", _graph_ops.functional_only)):
            with scope():
                gm = make_fx(functools.partial(_permute, g=g, perm=perm), tracing_mode="fake")(x)
            _graph_ops.reset()
            out[name][transport] = gm(x)
            out[name][transport + " ops"] = sorted({str(n.target) for n in gm.graph.nodes
                                                    if "c10d" in str(n.target) or "shm" in str(n.target)})
    return out
