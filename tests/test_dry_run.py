"""Dry runs (manifests, the cross-rank schedule check, activation estimates) of programs
meta tensors cannot run: model code that reads tensor values on the host, and a Hugging
Face Llama. Each gives what the real run communicates and leaves real values alone, the
varying-axes rules type every stand-in as they type meta tensors, and a program no
stand-in runs is an error saying what to do."""

from __future__ import annotations

import dry_run_cases as C
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.spmd import _schedule

MESH = fs.Mesh({"data": 2})
OPT = fs.optim.adamw(1e-3)


def _grad_bytes(params: dict) -> int:
    # Plain data parallelism over 2 shards: every fp32 gradient is all-reduced (bucketed); a
    # ring all-reduce sends 2(n-1)/n of the buffer per rank, the buffer itself for n = 2.
    return sum(4 * p.numel() for p in params.values())


def _only(kind, monkeypatch):
    monkeypatch.setattr(_schedule, "KINDS", (kind,))


def _meta(*shape):
    return torch.empty(*shape, device="meta")


# -- a model that reads values on the host --------------------------------------------------


def test_meta_tensors_cannot_run_the_host_reads():
    """The premise: on meta tensors the model's host reads fail."""
    m = C.model(True)
    p = {k: v.to("meta") for k, v in C.params_of(m).items()}
    with pytest.raises(RuntimeError, match="meta"):
        C.loss_of(m)(p, {k: v.to("meta") for k, v in C.batch().items()})


def test_host_reads_manifest_on_the_virtual_mesh_leaves_the_state_alone():
    """The manifest of the host-reading model is the plain model's: the gradient bytes in
    one bucket and the loss's pmean. Listing it (on copies of device 0's values, donated
    state and all) leaves the state as it was."""
    m = C.model(True)
    step = fs.train_step(C.loss_of(m), OPT, mesh=MESH, donate=True)
    state = step.init(C.params_of(m))
    before = [t.clone() for t in T.flat(state)]
    man = step.collectives(state, C.batch())
    assert all(torch.equal(a, b) for a, b in zip(T.flat(state), before))
    assert C.manifest(man) == C.steps(False, mesh=MESH, n=0)["manifest"]
    assert [(e.op, e.shape) for e in man] == [("psum", (sum(p.numel() for p in C.params_of(m).values()),)),
                                              ("psum", ())]
    assert man.total_bytes() == _grad_bytes(C.params_of(m)) + 4


def test_host_reads_estimate_memory_matches_a_measured_step():
    """The estimate runs on real values (the notes say so) and matches the live bytes of a
    real step on one device (within 10%, as the meta estimate of the plain model does)."""
    one = fs.Mesh({"data": 1})
    for host_reads in (True, False):
        m, b = C.model(host_reads), C.batch()
        step = fs.train_step(C.loss_of(m), OPT, mesh=one)
        state = step.init(C.params_of(m))
        with fs.memory.track() as mem:
            mem.register(state.params, "parameters")
            mem.register(state.opt_state, "optimizer state")
            step(state, b)
        measured = mem.peak_of(("activations",))
        est = fs.estimate_memory(C.params_of(m), P(), OPT, mesh=one, loss=C.loss_of(m), batch=b)
        assert abs(est.activations - measured) <= 0.1 * measured, (host_reads, est.activations, measured)
        assert ("real values on CPU" if host_reads else "meta tensors") in est.notes[-1]
        if host_reads:
            two = fs.estimate_memory(C.params_of(m), P(), OPT, mesh=MESH, loss=C.loss_of(m), batch=b)
            assert 0 < two.activations < est.activations  # half the batch per device


@pytest.mark.multiprocess
def test_gloo_two_ranks_host_reads():
    """On 2 gloo ranks: the first step's schedule check runs (on real values) and changes
    nothing (the same parameters as without the check, and with donated state); the
    manifest equals the plain model's and the virtual mesh's."""
    from fsharded.testing import run_on_ranks

    per_rank = run_on_ranks(C.on_ranks, 2, 2)
    virtual = C.steps(True, mesh=MESH, n=0)["manifest"]
    for res in per_rank:
        assert res["checked"]["manifest"] == res["plain"]["manifest"] == virtual
        assert all(r["own"] == virtual for r in res.values())
        assert res["checked"]["losses"] == res["unchecked"]["losses"] == res["plain"]["losses"]
        for k, v in res["unchecked"]["params"].items():
            assert torch.equal(res["checked"]["params"][k], v), k
            # The in-place update rounds like the pure one up to fp32 reassociation.
            torch.testing.assert_close(res["donated"]["params"][k], v, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(T.flat(per_rank[0]["checked"]["params"]),
                                                 T.flat(per_rank[1]["checked"]["params"])))


# -- a Hugging Face Llama -------------------------------------------------------------------


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss(p, batch):
        kw = {"labels": batch["labels"]}
        if "attention_mask" in batch:  # its checks read the mask on the host, unless traced
            kw["attention_mask"] = batch["attention_mask"]
        return torch.func.functional_call(model, p, (batch["input_ids"],), kw).loss

    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, params, loss, {"input_ids": ids, "labels": ids}


# vmap runs the CPU attention kernel one example at a time on the virtual mesh, and says so.
@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_llama_manifest_is_its_gradient_bytes():
    model, params, loss, batch = _llama()
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    step = fs.train_step(loss, OPT, mesh=MESH)
    man = step.collectives(step.init(params), batch)
    n = sum(p.numel() for p in model.parameters())
    assert [(e.op, e.axis, e.shape) for e in man] == [("psum", "data", (n,)), ("psum", "data", ())]
    assert man.total_bytes() == _grad_bytes(params) + 4


def test_llama_estimate_memory_matches_a_measured_step():
    """Meta tensors cannot run it (its rotary embedding asks autocast for the device type);
    fake ones can, and measure what a real step allocates (within 10%). With a mask its
    checks skip under the tracing guards (explicit masks: a little more memory)."""
    _, params, loss, batch = _llama()
    one = fs.Mesh({"data": 1})
    step = fs.train_step(loss, OPT, mesh=one)
    state = step.init(params)
    with fs.memory.track() as mem:
        mem.register(state.params, "parameters")
        mem.register(state.opt_state, "optimizer state")
        step(state, batch)
    measured = mem.peak_of(("activations",))
    est = fs.estimate_memory(params, P(), OPT, mesh=one, loss=loss, batch=batch)
    assert abs(est.activations - measured) <= 0.1 * measured, (est.activations, measured)
    assert "fake tensors" in est.notes[-1]
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    masked = fs.estimate_memory(params, P(), OPT, mesh=one, loss=loss, batch=batch)
    assert measured <= masked.activations <= 1.25 * measured


# -- every stand-in, the same answers --------------------------------------------------------

KINDS = [_schedule.FAKE, _schedule.TRACED, _schedule.REAL]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_stand_in_is_typed_like_meta(kind, monkeypatch):
    """The varying-axes rules run on every stand-in as on meta tensors: a psum of a value
    invariant over its axis is not communicated, an invariant value differentiated
    against a varying one gets its implicit pvary (a psum in backward), and an out_spec
    that leaves out an axis the output varies over is a ValueError."""
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    w, x = torch.randn(3, 2), torch.randn(4, 3)

    def f(w, x):  # w replicated (invariant), x split over data
        s = fs.psum(x.sum(), "data")
        s = fs.psum(s, "data")  # a typed invariant value: 2 * s, nothing sent
        g = torch.func.grad(lambda w: (x @ w).sum())(w)  # implicit pvary: psum over data
        return s + g.sum()

    sm = fs.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    want = sm.collectives(w, x)
    assert [(e.phase, e.op, e.axis) for e in want] == [("forward", "psum", "data"), ("backward", "psum", "data")]
    _only(kind, monkeypatch)
    assert sm.collectives(w, x) == want
    bad = fs.shard_map(lambda w, x: x * 2, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(Exception) as err:  # noqa: PT011 - alone, the kind reports it as a DryRunError
        bad.collectives(w, x)
    cause = err.value.__cause__ if isinstance(err.value, _schedule.DryRunError) else err.value
    assert isinstance(cause, ValueError) and "out_specs must name every mesh axis" in str(cause)


def test_step_manifests_on_real_values_are_the_meta_ones(monkeypatch):
    """The bundled GPT's train_step on data x tensor parallelism at ZeRO stages 0 and 3
    (per block): device 0 alone on real values (the real ranks' program, without vmap)
    lists what meta tensors list on the virtual mesh. (Fake tensors run the program meta
    tensors run, under the same vmap: the typing test above covers them.)"""
    params = gpt.init(T.CONFIG, 0)
    b = T.batches(1)[0]
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    manifests = {}
    for stage in (0, 3):
        plan = fs.parallel.zero(stage, min_size=16)(gpt.tensor_parallel_specs(params), params)
        step = fs.train_step(gpt.loss, OPT, mesh=mesh, param_specs=plan, blocks="blocks", clip=1.0)
        manifests[stage] = (step, step.init(params), step.collectives(step.init(params), b))
    _only(_schedule.REAL, monkeypatch)
    for stage, (step, state, want) in manifests.items():
        got = step.collectives(state, b)
        assert len(want) > 4 and got == want, stage


@pytest.mark.parametrize("kind", _schedule.KINDS, ids=lambda k: k.name)
def test_captured_tensors_are_left_alone(kind, monkeypatch):
    """A program that writes tensors it captured (a counter, a BatchNorm's running
    statistics) finds them as they were after a dry run on any stand-in."""
    counter, bn = torch.zeros(()), torch.nn.BatchNorm1d(3)
    before = {k: v.clone() for k, v in bn.state_dict().items()}

    def f(x):
        counter.add_(1)
        if kind is _schedule.REAL:  # vmap cannot write a batch's statistics into a buffer
            x = bn(x)
        return fs.psum(x.sum(), "data")

    _only(kind, monkeypatch)
    m = fs.shard_map(f, mesh=MESH, in_specs=(P("data"),), out_specs=P()).collectives(torch.randn(8, 3))
    assert [(e.op, e.shape) for e in m] == [("psum", ())]
    assert counter.item() == 0
    assert all(torch.equal(v, before[k]) for k, v in bn.state_dict().items())


def test_estimate_memory_leaves_captured_tensors_alone():
    bn = torch.nn.BatchNorm1d(3)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    loss = lambda p, b: (bn(b["x"] @ p["w"]) ** 2).mean()  # noqa: E731
    est = fs.estimate_memory({"w": torch.randn(3, 3)}, P(), OPT, mesh=MESH, loss=loss,
                             batch={"x": torch.randn(8, 3)})
    assert est.activations > 0
    assert all(torch.equal(v, before[k]) for k, v in bn.state_dict().items())


# -- programs no stand-in runs ----------------------------------------------------------------


def test_a_program_no_stand_in_runs_says_what_to_do():
    """Meta arguments are zeros on real values, which this program refuses: the error
    names the line and what each stand-in hit, and says what to do, in the words of the
    caller (collectives, the schedule check, estimate_memory)."""
    sm = fs.shard_map(C.needs_values, mesh=MESH, in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(_schedule.DryRunError) as err:
        sm.collectives(_meta(3, 2), _meta(4, 3))
    msg = str(err.value)
    assert "collectives()" in msg and "dry_run_cases.py" in msg and "if not bool((w != 0).any()):" in msg
    assert all(k.name in msg for k in _schedule.KINDS)
    assert "ValueError: weights are all zero" in msg and "torch.compiler.is_compiling()" in msg
    with pytest.raises(_schedule.DryRunError, match="check_schedule=False"):
        _schedule.dry_run(C.check_weights, _meta(3, 2))
    with pytest.raises(RuntimeError, match="activation_bytes="):
        fs.estimate_memory({"w": _meta(3, 2)}, P(), OPT, mesh=MESH, loss=C.needs_values_loss,
                           batch={"x": torch.randn(4, 3)})


def test_the_programs_own_errors_are_raised_as_they_are():
    """An error that does not depend on the stand-ins is the program's, raised unchanged:
    one raised the same on meta and fake tensors (a KeyError), or on meta tensors and real
    values."""
    sm = fs.shard_map(lambda p: fs.psum(p["nope"], "data"), mesh=MESH, in_specs=(P(),), out_specs=P())
    with pytest.raises(KeyError, match="nope"):
        sm.collectives({"w": torch.zeros(2)})

    def unsupported(x):
        raise RuntimeError("this model needs a GPU")

    sm = fs.shard_map(unsupported, mesh=MESH, in_specs=(P(),), out_specs=P())
    with pytest.raises(RuntimeError, match="needs a GPU") as err:
        sm.collectives(torch.zeros(2))
    assert not isinstance(err.value, _schedule.DryRunError)
