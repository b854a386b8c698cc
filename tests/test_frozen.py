"""Frozen parameters (``requires_grad_(False)``, LoRA adapters, ``trainable=``): never
differentiated, stored, communicated or updated; everything else trained as plain PyTorch
trains it. On the virtual mesh, on gloo ranks, and the two against each other."""

from __future__ import annotations

import frozen_cases as C
import optree
import pytest
import torch
from torch import nn

import fsharded as fs
from fsharded import P

# fp32 AdamW at lr 0.1 over 3 steps: the sharded step sums gradients in another order than
# one process does (bucketed reductions over 2 shards), about 1e-7 relative per step,
# which Adam's normalisation can raise to ~1e-6 on small second moments.
TOL = dict(rtol=1e-5, atol=1e-5)
FROZEN = ("embed.", "blocks.0.")


@pytest.fixture(scope="module")
def reference():
    return C.plain_pytorch()


def _check_against(r: dict, ref: dict) -> None:
    for k, v in ref["params"].items():
        if k.startswith(FROZEN):  # frozen: bit for bit what it was
            assert torch.equal(r["params"][k], r["before"][k]), k
        else:
            assert not torch.equal(r["params"][k], r["before"][k]), k  # it did train
            torch.testing.assert_close(r["params"][k], v, **TOL, msg=k)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_leaves_are_untouched_and_the_rest_trains_as_pytorch(stage, reference):
    r = C.train(stage, 2)
    _check_against(r, reference)
    # Optimizer state (AdamW's two moments) for the 14 trained leaves only, of 22.
    assert r["opt_leaves"] == 2 * 14
    assert r["trainable"].tolist() == [not k.startswith(FROZEN) for k in r["params"]]


def test_zero3_without_blocks_and_donated_fused_updates(reference):
    with pytest.warns(UserWarning, match="without blocks= gathers every parameter"):
        _check_against(C.train(3, 2, blocks=False), reference)
    _check_against(C.train(0, 2, donate=True), reference)  # the fused in-place update
    _check_against(C.train(2, 2, donate=True), reference)


@pytest.mark.multiprocess
def test_gloo_ranks_equal_pytorch_and_the_virtual_mesh(reference):
    from fsharded.testing import run_on_ranks

    virtual = C.all_cases(2)
    for rank, res in enumerate(run_on_ranks(C.all_cases, 2, 2)):
        for name, r in res.items():
            _check_against(r, reference)
            assert r["opt_leaves"] == virtual[name]["opt_leaves"], (rank, name)
            for k, v in virtual[name]["params"].items():
                torch.testing.assert_close(r["params"][k], v, rtol=1e-6, atol=1e-6, msg=f"{rank} {name} {k}")


def test_no_gradient_of_a_frozen_leaf_is_communicated():
    r0 = C.manifest(0, 2)
    trained, frozen = r0["trainable_numel"], r0["frozen_numel"]
    # Stage 0: one bucketed all-reduce of the trained gradients (fp32), besides the loss's.
    assert [b for op, _, b in r0["ops"] if op == "psum" and b > 4] == [trained * 4]
    r2 = C.manifest(2, 2)  # each rank sends half of the trained gradients' bytes
    assert sum(b for op, _, b in r2["ops"] if op == "psum_scatter") == trained * 4 // 2
    r3 = C.manifest(3, 2)
    # Stage 3: every leaf is gathered for use in forward (frozen ones too: they are sharded);
    # backward reduce-scatters the trained gradients only.
    assert sum(b for op, ph, b in r3["ops"] if op == "all_gather" and ph == "forward") == (trained + frozen) * 2
    assert sum(b for op, ph, b in r3["ops"] if op == "psum_scatter") == trained * 2


def test_memory_estimate_counts_no_state_for_frozen_leaves():
    m = C.model()
    fm = fs.nn.functional(m)
    trained = sum(p.numel() for p in m.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in m.parameters() if not p.requires_grad)
    mesh = fs.Mesh({"data": 1})
    counters = 2 * 8  # AdamW's step counts (int64), besides its two fp32 moments
    est = fs.estimate_memory(fm.params, P(), fs.optim.adamw(0.1), mesh=mesh, blocks=None)
    assert est.optimizer == 2 * trained * 4 + counters and est.placed_grads == trained * 4
    assert est.master == (trained + frozen) * 4
    every = fs.estimate_memory(fm.params, P(), fs.optim.adamw(0.1), mesh=mesh, blocks=None, trainable=True)
    assert every.optimizer == 2 * (trained + frozen) * 4 + counters
    # A frozen leaf kept in bf16 counts 2 bytes, and no master copy.
    half = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "b": torch.zeros(64)}
    est = fs.estimate_memory(half, P(), fs.optim.adamw(0.1), mesh=mesh, trainable={"w": False, "b": True})
    assert est.master == 64 * 64 * 2 + 64 * 4 and est.optimizer == 2 * 64 * 4 + counters


def test_trainable_forms_and_their_errors():
    params = {"a": {"w": torch.randn(3, 3), "b": torch.randn(3)}, "c": torch.randn(3)}

    def loss(p, b):
        return (b @ p["a"]["w"] + p["a"]["b"] + p["c"]).square().sum()

    batch = torch.randn(4, 3)
    forms = {
        "prefix": {"a": False, "c": True},
        "rules": [("a.*", False), ("*", True)],
        "function": lambda path, x: not path.startswith("a."),
    }
    for name, t in forms.items():
        step = fs.train_step(loss, fs.optim.sgd(0.1), mesh=fs.Mesh({"data": 2}), trainable=t)
        state = step.init(params)
        new, _ = step(state, batch)
        assert torch.equal(new.params["a"]["w"], params["a"]["w"]), name
        assert not torch.equal(new.params["c"], params["c"]), name
    # nn.Parameter flags, as dict(model.named_parameters()) gives them
    w = nn.Parameter(torch.randn(3, 3), requires_grad=False)
    step = fs.train_step(lambda p, b: (b @ p["w"] + p["v"]).square().sum(), fs.optim.sgd(0.1))
    state = step.init({"w": w, "v": nn.Parameter(torch.randn(3))})
    assert state.trainable.tolist() == [True, False]  # flatten order: v, w
    with pytest.raises(ValueError, match="every parameter is frozen"):
        fs.train_step(loss, fs.optim.sgd(0.1), trainable=False).init(params)
    with pytest.raises(ValueError, match=r"(?s)no rule says.*params\.c.*\('\*', False\)"):
        fs.train_step(loss, fs.optim.sgd(0.1), trainable=[("a.*", True)]).init(params)
    with pytest.raises(ValueError, match=r"pattern\(s\) \['z\*'\] match no parameter path"):
        fs.train_step(loss, fs.optim.sgd(0.1), trainable=[("z*", True), ("*", True)]).init(params)
    with pytest.raises(TypeError, match=r"trainable\.a: int"):
        fs.train_step(loss, fs.optim.sgd(0.1), trainable={"a": 1, "c": True}).init(params)
    with pytest.raises(ValueError, match="trainable"):
        fs.train_step(loss, fs.optim.sgd(0.1), trainable={"a": True}).init(params)


def test_fm_records_the_flags_and_a_cast_copy_takes_them_explicitly(reference):
    m = C.model()
    fm = fs.nn.functional(m)
    paths, flags, _ = fs.tree_flatten_with_paths(fm.trainable)
    assert dict(zip(paths, flags)) == {k: p.requires_grad for k, p in m.named_parameters()}
    # A copy loses the mark on the detached leaves: trainable=fm.trainable says it again.
    copied = optree.tree_map(torch.clone, fm.params)
    step = fs.train_step(lambda p, b: fm.apply(p, b["idx"], b["y"]), fs.optim.adamw(C.LR, weight_decay=0.01),
                         mesh=fs.Mesh({"data": 2}), trainable=fm.trainable)
    state = step.init(copied)
    for b in C.batches():
        state, _ = step(state, b)
    assert torch.equal(state.params["embed"]["weight"], m.embed.weight)
    torch.testing.assert_close(state.params["head"]["weight"], reference["params"]["head.weight"], **TOL)


def test_a_frozen_leaf_keeps_its_dtype_bit_for_bit():
    w = torch.randn(4, 4).to(torch.bfloat16)
    params = {"w": w, "v": torch.randn(4)}
    step = fs.train_step(lambda p, b: (b @ p["w"].float() + p["v"]).square().sum(), fs.optim.adamw(0.1),
                         mesh=fs.Mesh({"data": 2}), precision="bf16", trainable={"w": False, "v": True})
    state = step.init(params)
    assert state.params["w"].dtype == torch.bfloat16 and state.params["v"].dtype == torch.float32
    for _ in range(2):
        state, _ = step(state, torch.randn(2, 4))
    assert torch.equal(state.params["w"], w)


def test_save_and_load_keep_which_leaves_train(tmp_path, reference):
    m = C.model()
    fm = fs.nn.functional(m)

    def make(**kw):
        return fs.train_step(lambda p, b: fm.apply(p, b["idx"], b["y"]), fs.optim.adamw(C.LR, weight_decay=0.01),
                             mesh=fs.Mesh({"data": 2}), param_specs=fs.parallel.zero(3, min_size=1)(P(), fm.params),
                             blocks=fm.blocks, **kw)

    step = make()
    state = step.init(fm.params)
    bs = C.batches()
    state, _ = step(state, bs[0])
    step.save(state, tmp_path / "ck")
    # A new step without a template: the checkpoint says which leaves it trained.
    fresh = make()
    loaded = fresh.load(tmp_path / "ck")
    assert torch.equal(loaded.trainable, state.trainable)
    for b in bs[1:]:
        loaded, _ = fresh(loaded, b)
    out = fresh.params(loaded)
    assert torch.equal(out["blocks"][0]["fc1"]["weight"], m.blocks[0].fc1.weight)
    torch.testing.assert_close(out["head"]["weight"], reference["params"]["head.weight"], **TOL)
    with pytest.raises(ValueError, match=r"(?s)saved training other parameters.*params\.embed\.weight: frozen "
                                         r"in the checkpoint, trained here"):
        make(trainable=True).load(tmp_path / "ck")


@pytest.mark.parametrize("kind,stage", [("llama", 0), ("llama", 3), ("gpt2", 2)])
def test_peft_lora_trains_only_its_adapters_as_pytorch_does(kind, stage):
    pytest.importorskip("peft")
    model = C.lora_model(kind)
    ref = C.lora_copy(model)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (4, 8), generator=g) for _ in range(3)]
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for ids in batches:
        loss = ref(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    fm = fs.nn.functional(model)
    assert fm.blocks.endswith((".model.layers", ".transformer.h"))  # found under peft's wrapper
    step = fs.train_step(lambda p, b: fm.apply(p, input_ids=b, labels=b).loss,
                         fs.optim.adamw(1e-2, weight_decay=0.01), mesh=fs.Mesh({"data": 2}),
                         param_specs=fs.parallel.zero(stage, min_size=1)(P(), fm.params), blocks=fm.blocks)
    state = step.init(fm.params)
    for ids in batches:
        state, _ = step(state, ids)
    got = dict(zip(fs.tree_flatten_with_paths(state.params)[0], optree.tree_leaves(step.params(state))))
    want = dict(ref.named_parameters())
    changed = [k for k in got if not torch.equal(got[k], before[k])]
    assert changed and all("lora_" in k for k in changed)
    assert len(changed) == sum(p.requires_grad for p in model.parameters())
    for k, v in got.items():
        torch.testing.assert_close(v, want[k].detach(), rtol=1e-5, atol=1e-5, msg=k)
