"""Compiled against eager steps (``train_step(compile=True)``), shared by the compile tests."""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F
import train_cases as T

import fsharded as fs
from fsharded import P
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
    return out


def gloo_refused(world: int) -> str:
    """On each rank: the error of a compiled step over a tensor axis (not built on real ranks)."""
    step, params = gpt_step(True, mesh={"data": 1, "tensor": world})
    try:
        step(step.init(params), T.batches(1)[0])
    except NotImplementedError as e:
        return str(e)
    return ""
