"""fs.parallel.tensor: Megatron tensor parallelism for plain nn.Modules, planned by parameter
path. Sharded forward and gradients equal the unsharded module (float64), training equals a
plain PyTorch loop (fp32), on the virtual mesh and on 4 gloo ranks; a plan that does not fit
the model, or specs without the plan's collectives, is an error naming what is wrong."""

from __future__ import annotations

import doctest

import pytest
import tensor_plan_cases as C
import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt, gpt_plans
from fsharded.parallel import tensor as T

# float64, the same arithmetic in another order (matmuls split over 2 shards, sums over
# shards): measured <= 1e-15 absolute on O(1) values; 1e-10 leaves a wide margin and still
# catches any missing or doubled term (those are O(1e-2) here).
F64 = dict(rtol=1e-10, atol=1e-10)
# fp32, 20 AdamW steps: rounding differences of ~1e-7 in the gradients move the parameters
# by ~1e-6 (measured <= 3e-6); the brief's bound.
F32 = dict(rtol=1e-5, atol=1e-5)
MESHES = [{"tensor": 2}, {"data": 2, "tensor": 2}]


def _close(a, b, **tol):
    la, lb = C.leaves(a), C.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **tol)


def _check_grads(res: dict) -> None:
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = res["ref"], res["tp"]
    _close(logits, ref_logits, **F64)
    _close(loss, ref_loss, **F64)
    assert set(grads) == set(ref_grads)
    _close({k: grads[k] for k in ref_grads}, ref_grads, **F64)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
@pytest.mark.parametrize("model,plan", [("llama", "llama"), ("llama", "llama_vocab"),
                                        ("nanogpt", "nanogpt"), ("nanogpt", "nanogpt_mlp")])
def test_forward_and_grads_equal_unsharded(model, plan, mesh):
    _check_grads(C.grads_case(model, plan, mesh))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_replicated_input_gets_its_gradient_summed_over_tensor_shards(mesh):
    res = C.input_grad_case(mesh)
    _close(res["tp"], res["ref"], **F64)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_hf_llama_for_causal_lm(mesh):
    pytest.importorskip("transformers")
    _check_grads(C.grads_case("hf_llama", "llama_vocab", mesh))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_hf_gpt2_conv1d(mesh):
    """GPT-2's Conv1D layers ([in, out] weights): the MLP split colwise/rowwise with the
    transposed specs and the tied vocabulary split, against the unsharded model."""
    pytest.importorskip("transformers")
    res = C.grads_case("hf_gpt2", "gpt2", mesh)
    _check_grads(res)
    tp = T.plan(C.make("hf_gpt2"), C.PLANS["gpt2"], axis="tensor")
    assert tp.specs["inner.transformer.h.0.mlp.c_fc.weight"] == P(None, "tensor")
    assert tp.specs["inner.transformer.h.0.mlp.c_fc.bias"] == P("tensor")
    assert tp.specs["inner.transformer.h.0.mlp.c_proj.weight"] == P("tensor", None)
    assert tp.specs["inner.transformer.h.0.mlp.c_proj.bias"] == P()
    with pytest.raises(ValueError, match="fused q,k,v"):
        T.plan(C.make("hf_gpt2"), {"inner.transformer.h.*.attn.c_attn.weight": "colwise"}, axis="tensor")


def _check_training(res: dict, plain: dict, model: str) -> None:
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(plain["losses"]), **F32)
    assert set(res["params"]) == set(plain["params"])
    for name, ref in plain["params"].items():
        got = res["params"][name]
        if model in ("nanogpt", "hf_gpt2") and name.endswith("attn.c_attn.bias"):
            # The key bias (the middle third of the fused bias) has zero gradient exactly
            # (softmax ignores a shift shared by a row of scores); its computed gradient is
            # rounding noise, which Adam normalizes into lr-sized steps of arbitrary sign:
            # it differs by ~5e-4 between the plain loop on 1 and on 2 data shards too.
            d = ref.numel() // 3
            got, ref = torch.cat([got[:d], got[2 * d:]]), torch.cat([ref[:d], ref[2 * d:]])
        torch.testing.assert_close(got, ref, **F32, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("model,plan", [("llama", "llama_vocab"), ("nanogpt", "nanogpt"),
                                        ("hf_gpt2", "gpt2")])
def test_train_step_equals_plain_torch_loop(model, plan):
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    _check_training(C.train_plan(model, plan, {"data": 2, "tensor": 2}), C.train_plain(model), model)


def test_collectives_are_megatrons():
    """Two psums over "tensor" per layer in forward (after o_proj, after down_proj) and two
    in backward (the transposes of one pvary per q/k/v and per gate/up group): the shared
    input is pvary'd once, not once per projection."""
    module = C.make("llama", torch.float32)
    tp = T.plan(module, T.LLAMA, axis="tensor")
    step = fs.train_step(tp.wrap(lambda p, b: C.lm_loss(tp.apply(p, b[:, :-1]), b)),
                         fs.optim.adamw(C.LR), mesh=fs.Mesh({"data": 2, "tensor": 2}),
                         param_specs=tp.specs)
    entries = step.collectives(step.init(tp.params), C.tokens())
    tensor_psums = [(e.phase, tuple(e.shape)) for e in entries if e.op == "psum" and e.axis == "tensor"]
    act = (C.BATCH // 2, C.Config.seq, C.Config.dim)
    n = 2 * C.Config.layers
    assert tensor_psums.count(("forward", act)) == n
    assert tensor_psums.count(("backward", act)) == n


def test_specs_without_the_plan_are_refused():
    msg = C.specs_only_error({"data": 2, "tensor": 2})
    assert "the loss varies over mesh axis 'tensor'" in msg


@pytest.mark.multiprocess
def test_gloo_four_ranks():
    from fsharded.testing import run_on_ranks

    results = run_on_ranks(C.gloo_cases, 4)
    mesh = {"data": 2, "tensor": 2}
    ref_llama = C.grads_case("llama", "llama_vocab", mesh)  # with the virtual mesh's own
    ref_nano = C.grads_case("nanogpt", "nanogpt", mesh)
    ref_input = C.input_grad_case(mesh)
    plain = {m: C.train_plain(m) for m in ("llama", "nanogpt")}
    ref_gpt2 = C.grads_case("hf_gpt2", "gpt2", mesh) if "grads_gpt2" in results[0] else None
    for res in results:
        if ref_gpt2 is not None:  # HF GPT-2's Conv1D layers on real ranks
            _check_grads({"ref": ref_gpt2["ref"], "tp": res["grads_gpt2"]})
        _check_grads({"ref": ref_llama["ref"], "tp": res["grads_llama_vocab"]})
        _check_grads({"ref": ref_nano["ref"], "tp": res["grads_nanogpt"]})
        _check_grads({"ref": ref_nano["tp"], "tp": res["grads_nanogpt"]})  # == virtual
        _close(res["input_grad"], ref_input["ref"], **F64)
        for m in ("llama", "nanogpt"):
            _check_training(res[f"train_{m}"], plain[m], m)
        assert "the loss varies over mesh axis 'tensor'" in res["specs_only"]


# -- the plan object ---------------------------------------------------------------------------


def test_specs_and_ties():
    tp = T.plan(C.make("nanogpt"), T.NANOGPT, axis="tp")
    s = tp.specs
    assert s["transformer.h.0.mlp.c_fc.weight"] == P("tp", None)
    assert s["transformer.h.0.mlp.c_fc.bias"] == P("tp")
    assert s["transformer.h.0.mlp.c_proj.weight"] == P(None, "tp")
    assert s["transformer.h.0.mlp.c_proj.bias"] == P()  # added once, after the psum
    assert s["transformer.wte.weight"] == P("tp", None)
    assert "lm_head.weight" not in s  # tied: one leaf; lm_head runs as a vocab head
    assert s["transformer.h.0.attn.c_attn.weight"] == P()
    text = repr(tp)
    assert "transformer.h.*.mlp.c_fc  colwise Linear x2" in text and "lm_head  vocab Linear" in text


def test_applied_is_inert_outside_shard_map_and_restores_forward():
    module = C.make("llama")
    tp = T.plan(module, C.PLANS["llama_vocab"], axis="tensor")
    ids = C.tokens()[:, :-1]
    want = module(ids)
    with tp.applied():
        assert "forward" in module.lm_head.__dict__
        torch.testing.assert_close(module(ids), want, rtol=0, atol=0)
    assert "forward" not in module.lm_head.__dict__
    # Replicated weights on a mesh with a tensor axis: the layers run as they are.
    f = fs.shard_map(tp.apply, mesh=fs.Mesh({"tensor": 2}), in_specs=(P(), P()), out_specs=P())
    torch.testing.assert_close(f(tp.params, ids), want, rtol=0, atol=0)


def test_fs_nn_object_and_zero3_blocks():
    """An ``fs.nn.functional`` object (nested params, blocks through run_block) with ZeRO-3
    over "data": the plan must be open around the step calls, since the step re-runs each
    block in backward; opened inside the loss it is refused, not silently wrong."""
    zoo = pytest.importorskip("model_zoo")
    if not hasattr(fs, "nn"):
        pytest.skip("fsharded.nn is not there")
    mesh = fs.Mesh({"data": 2, "tensor": 2})

    def run(zero: bool, around: bool):
        fm = fs.nn.functional(zoo.nanogpt())
        tp = T.plan(fm, T.NANOGPT, axis="tensor")
        assert tp.specs["transformer"]["h"][0]["mlp"]["c_fc"]["weight"] == P("tensor", None)
        specs = fs.parallel.zero(3, axis="data")(tp.specs, fm.params) if zero else tp.specs

        def loss(p, tok):
            return fm.apply(p, tok[:, :-1].contiguous(), tok[:, 1:].contiguous())[1]

        step = fs.train_step(loss if around else tp.wrap(loss), fs.optim.adamw(C.LR), mesh=mesh,
                             param_specs=specs, blocks=fm.blocks)
        state, losses = step.init(fm.params), []
        with tp.applied() if around else _nothing():
            for i in range(3):
                state, m = step(state, C.tokens(seed=i, vocab=256, seq=16))
                losses.append(float(m["loss"]))
        return losses, step.params(state)

    ref_losses, ref_params = run(zero=False, around=False)
    losses, params = run(zero=True, around=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **F32)
    _close(params, ref_params, **F32)
    with pytest.raises(RuntimeError, match="open it around the step calls"):
        run(zero=True, around=False)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_bundled_gpt_plan_is_its_own_specs():
    params = gpt.init(gpt.GPTConfig.tiny(), 0)
    assert gpt_plans.gpt_specs(params, axis="tp") == gpt.tensor_parallel_specs(params, "tp")


def test_docstring_example():
    assert doctest.testmod(T, raise_on_error=False).failed == 0


# -- errors --------------------------------------------------------------------------------------


def test_unmatched_pattern_is_named():
    with pytest.raises(ValueError, match=r"\*\.q_projection\.weight.*match no parameter path"):
        T.plan(C.make("llama"), {**T.LLAMA, "*.q_projection.weight": "colwise"}, axis="tensor")


def test_unknown_role_lists_the_roles():
    with pytest.raises(ValueError, match=r"(?s)'\*\.q_proj\.weight': 'column'.*colwise, rowwise, vocab, replicated"):
        T.plan(C.make("llama"), {"*.q_proj.weight": "column"}, axis="tensor")


def test_fused_qkv_as_colwise_is_refused():
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn.*fused q,k,v projection"):
        T.plan(C.make("nanogpt"), {**T.NANOGPT, "*.attn.c_attn.weight": "colwise"}, axis="tensor")


def test_roles_that_do_not_fit_the_module():
    with pytest.raises(ValueError, match=r"role 'colwise' needs an nn.Linear.*role 'vocab'"):
        T.plan(C.make("llama"), {"model.embed_tokens.weight": "colwise"}, axis="tensor")
    with pytest.raises(ValueError, match=r"'weight' is not a parameter|needs an nn.Linear"):
        T.plan(C.make("llama"), {"*.input_layernorm.weight": "rowwise"}, axis="tensor")


def test_heads_that_do_not_divide_are_named():
    """4 query and 2 key/value heads of head_dim 8 over 4 shards: k_proj would give each
    shard half a head."""
    module = C.make("llama")
    tp = T.plan(module, T.LLAMA, axis="tensor")
    f = fs.shard_map(tp.apply, mesh=fs.Mesh({"tensor": 4}), in_specs=(tp.specs, P()), out_specs=P())
    with pytest.raises(ValueError, match=r"k_proj has 4 output features per shard.*not a whole number of heads"):
        f(tp.params, C.tokens()[:, :-1])


def test_rowwise_after_a_replicated_layer_is_named():
    module = C.make("nanogpt")
    tp = T.plan(module, {"*.attn.c_proj.weight": "rowwise"}, axis="tensor")
    f = fs.shard_map(tp.apply, mesh=fs.Mesh({"tensor": 2}), in_specs=(tp.specs, P()), out_specs=P())
    with pytest.raises(ValueError, match=r"rowwise transformer\.h\.0\.attn\.c_proj expects its input split"):
        f(tp.params, C.tokens()[:, :-1])
