"""Hugging Face GPT-2 and Llama built with their default attention (SDPA) through
``fs.nn.functional`` + ``train_step``: no torch warning on the virtual mesh (torch has no
batching rule for its CPU SDPA kernel and warned, per layer), padding masks under vmap
(HF's SDPA mask read the mask's values and failed), attention dropout from fsharded's keys,
attention weights by HF's eager form, and the numbers of the model's own SDPA attention in
plain PyTorch, on the virtual mesh and on gloo ranks."""

from __future__ import annotations

import warnings

import optree
import pytest
import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import P

transformers = pytest.importorskip("transformers")

LR, WD, EPS, STEPS, BATCH, SEQ = 3e-3, 0.1, 1e-6, 4, 4, 17
# fp32. Without a mask, fsharded's attention runs torch's own fused CPU flash kernel, as
# SDPA does: outside a mesh the forward is bit-equal and the gradients within 1e-7. With a
# padding mask it forms the weights explicitly where SDPA's kernel accumulates blockwise
# (gradients within 5e-8). After 4 AdamW steps on data=2 (shard means, a pmean: sums in
# another order) the losses (~5.5) are within 1e-6 and the weights within 3.2e-6, on the
# virtual mesh and on 2 gloo ranks alike. Eager attention on the same padded batch is
# 4.9e-4 off in the first loss (rows a left padding leaves without any key: zeros in SDPA,
# an average of all keys in eager), so the tolerances tell the two apart.
# Adam's eps is 1e-6, not 1e-8: some weights have a true gradient of 0 at the first step
# (rounding noise of ~2e-9, different for the full batch and its shards), which Adam with
# eps 1e-8 turns into steps of a good part of lr (measured 8e-5 apart, in plain PyTorch
# alone); real gradients here are ~1e-3.
TOL = dict(rtol=0, atol=1e-5)
MESHES = [(0, {"data": 2}), (3, {"data": 2})]  # ZeRO-3 with blocks=fm.blocks
KINDS = ["gpt2", "llama"]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


def build(kind: str, seed: int = 0, dropout: float = 0.0, **overrides) -> torch.nn.Module:
    """The stock model from a tiny config, attn_implementation left at its default."""
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout, **overrides)
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       use_cache=False, attention_dropout=dropout, **overrides)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    assert model.config._attn_implementation == "sdpa"  # the default this file is about
    return model


def batches(padded: bool, n: int = STEPS, seed: int = 0) -> list[dict]:
    """Token batches from a pool of 8 sequences (memorisable: the loss falls). ``padded``:
    an attention mask with row 0 left-padded (its first queries see no key at all) and
    row 2 right-padded, one of each on each of the two data shards."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (8, SEQ), generator=g)
    out = []
    for _ in range(n):
        b = {"tokens": pool[torch.randint(0, 8, (BATCH,), generator=g)]}
        if padded:
            mask = torch.ones(BATCH, SEQ - 1, dtype=torch.long)
            mask[0, :5] = 0
            mask[2, 11:] = 0
            b["mask"] = mask
        out.append(b)
    return out


def loss_of(call, batch: dict) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (padded ones too: their outputs are
    SDPA's, so they are compared as well); a mean over equal shards is the global mean."""
    x, y = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    kw = {"attention_mask": batch["mask"]} if "mask" in batch else {}
    return F.cross_entropy(call(input_ids=x, **kw).logits.flatten(0, 1), y.flatten())


def plain_run(kind: str, padded: bool, attn: str = "sdpa", steps: int = STEPS) -> dict:
    """The stock model in plain PyTorch with its own attention (``attn``)."""
    model = build(kind)
    model.set_attn_implementation(attn)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for b in batches(padded, steps):
        loss = loss_of(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def step_run(kind: str, padded: bool, stage: int, mesh: dict, *, dropout: float = 0.0,
             steps: int = STEPS) -> dict:
    model = build(kind, dropout=dropout)
    fm = fs.nn.functional(model)
    step = fs.train_step(lambda p, b: loss_of(lambda **kw: fm.apply(p, **kw), b),
                         fs.optim.adamw(LR, weight_decay=WD, eps=EPS), mesh=fs.Mesh(mesh), blocks=fm.blocks,
                         param_specs=fs.parallel.zero(stage, min_size=16)(P(), fm.params))
    state = step.init(fm.params)
    losses = []
    for b in batches(padded, steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    fs.nn.load_into(model, step.params(state))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "attn": model.config._attn_implementation}


_PLAIN: dict = {}


def plain(kind: str, padded: bool) -> dict:
    if (kind, padded) not in _PLAIN:
        _PLAIN[kind, padded] = plain_run(kind, padded)
    return _PLAIN[kind, padded]


def assert_matches(res: dict, ref: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL,
                               msg=lambda m: f"{what}: losses: {m}")
    for name, p in ref["params"].items():  # the weights after the steps: the gradients
        torch.testing.assert_close(res["params"][name], p, rtol=0, atol=1e-5,  # measured <= 3.2e-6
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


# --- training on the virtual mesh: no warning, SDPA's numbers ---------------------------


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padding-mask"])
@pytest.mark.parametrize("kind", KINDS)
def test_trains_with_its_default_attention_without_a_warning(kind, padded, capfd):
    ref = plain(kind, padded)
    assert ref["losses"][0] - ref["losses"][-1] > 0.05  # it trains: the comparison has teeth
    for stage, mesh in MESHES:
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = step_run(kind, padded, stage, mesh)
        assert [str(w.message) for w in caught] == []
        assert capfd.readouterr().err == ""  # nor a TORCH_WARN or a transformers log line
        assert_matches(res, ref, f"{kind} ZeRO-{stage} {mesh}")
        assert res["attn"] == "sdpa"  # the model the user passed still reads its own


def test_a_padding_mask_is_sdpas_not_eagers():
    """The comparison above tells the two apart: rows a left padding leaves without any key
    are zeros in SDPA and an average over all keys in eager attention."""
    sdpa, eager = plain("gpt2", True), plain_run("gpt2", True, attn="eager", steps=1)
    assert abs(sdpa["losses"][0] - eager["losses"][0]) > 20 * TOL["atol"]


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padding-mask"])
@pytest.mark.parametrize("kind", KINDS)
def test_apply_outside_a_mesh_equals_the_model_forward_and_gradients(kind, padded):
    model = build(kind)
    fm = fs.nn.functional(model)
    b = batches(padded, 1)[0]
    params = optree.tree_map(lambda t: t.clone().requires_grad_(), fm.params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = loss_of(lambda **kw: fm.apply(params, **kw), b)
        got.backward()
    assert [str(w.message) for w in caught] == []
    want = loss_of(model, b)
    want.backward()
    grads = dict(zip(fs.tree_flatten_with_paths(params)[0], [p.grad for p in optree.tree_leaves(params)]))
    # fp32 (see TOL): measured bit-equal losses, gradients within 1e-7
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert model.config._attn_implementation == "sdpa"


# --- dropout from fsharded's keys -------------------------------------------------------


def test_dropout_draws_from_the_scope_key_as_hfs_sdpa_does():
    """GPT-2's default dropouts (0.1, attention weights included) in train mode: apply under
    fs.random.scope(k) equals the stock SDPA model under the same scope (whose SDPA the scope
    runs as keyed math), forward and gradients; another key draws other masks."""
    model = build("gpt2", dropout=0.1).train()
    fm = fs.nn.functional(model, blocks=False)  # run_block forks a key per block: keep the plain order
    b = batches(False, 1)[0]

    def run(key, call, params):
        with fs.random.scope(key):
            loss = loss_of(call, b)
        leaves = optree.tree_leaves(params)
        return loss, torch.autograd.grad(loss, leaves)

    params = optree.tree_map(lambda t: t.clone().requires_grad_(), fm.params)
    got = run(fs.random.key(1), lambda **kw: fm.apply(params, **kw), params)
    names = fs.tree_flatten_with_paths(fm.params)[0]
    want = run(fs.random.key(1), model, [dict(model.named_parameters())[n] for n in names])
    other = run(fs.random.key(2), lambda **kw: fm.apply(params, **kw), params)
    # the same ops in the same order as the scope's keyed SDPA: measured bit-equal
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    for n, g, w in zip(names, got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert abs((got[0] - other[0]).item()) > 1e-3


def test_dropout_in_a_step_is_reproducible_and_warns_nothing():
    runs = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(step_run("gpt2", True, 3, {"data": 2}, dropout=0.1, steps=3))
        assert [str(w.message) for w in caught] == []
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["losses"] != plain_run("gpt2", True, steps=3)["losses"]  # dropout did act


# --- attention weights, head masks, refusals, the module left alone ----------------------


@pytest.mark.parametrize("kind", KINDS)
def test_output_attentions_runs_hfs_eager_attention(kind):
    """SDPA gives no weights (HF warns and returns None): apply runs eager for that call."""
    model = build(kind)
    fm = fs.nn.functional(model)
    x = batches(False, 1)[0]["tokens"][:, :-1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fm.apply(fm.params, input_ids=x, output_attentions=True)
    assert [str(w.message) for w in caught] == []
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    want = model(input_ids=x, output_attentions=True)
    assert len(got.attentions) == 2 and all(a is not None for a in got.attentions)
    for g, w in zip(got.attentions, want.attentions):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)


def test_gpt2_head_mask_runs_hfs_eager_attention():
    """HF's SDPA drops a head mask; eager applies it: so does apply."""
    model = build("gpt2")
    fm = fs.nn.functional(model)
    x = batches(False, 1)[0]["tokens"][:, :-1]
    head_mask = torch.tensor([[1.0, 0.0], [0.5, 1.0]])
    got = fm.apply(fm.params, input_ids=x, head_mask=head_mask).logits
    model.set_attn_implementation("eager")
    torch.testing.assert_close(got, model(input_ids=x, head_mask=head_mask).logits, rtol=0, atol=0)


def test_sinks_and_soft_capping_are_refused():
    from fsharded.nn._hf_attention import sdpa_attention

    q = torch.randn(1, 2, 4, 8)
    for kw in ({"s_aux": torch.zeros(2)}, {"softcap": 30.0}):
        with pytest.raises(NotImplementedError, match="attn_implementation='eager'"):
            sdpa_attention(torch.nn.Module(), q, q, q, None, **kw)


def test_the_model_is_left_as_it_was():
    """The config reads fsharded's attention only while apply runs, and "sdpa" again after,
    also when the forward fails half-way; transformers' own "sdpa" is untouched."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = build("llama")
    fm = fs.nn.functional(model)
    assert model.config._attn_implementation == "sdpa"
    seen = []

    def fail(module, args):
        seen.append(model.config._attn_implementation)
        raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(KeyboardInterrupt):
        fm.apply(fm.params, input_ids=batches(False, 1)[0]["tokens"])
    handle.remove()
    assert seen == ["fsharded_sdpa"]
    assert model.config._attn_implementation == "sdpa"
    assert "forward" not in model.model.layers[0].__dict__
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


# --- gloo ranks -------------------------------------------------------------------------


def gloo_runs() -> dict:
    torch.set_num_threads(1)
    out = {(k, padded, 3): step_run(k, padded, 3, {"data": 2}) for k in KINDS for padded in (False, True)}
    out["dropout"] = step_run("gpt2", True, 3, {"data": 2}, dropout=0.1, steps=3)
    return out


@pytest.mark.multiprocess
def test_gloo_two_ranks_equal_plain_and_the_virtual_mesh():
    from fsharded.testing import run_on_ranks

    per_rank = run_on_ranks(gloo_runs, 2)
    for kind in KINDS:
        for padded in (False, True):
            for rank, res in enumerate(per_rank):
                assert_matches(res[kind, padded, 3], plain(kind, padded), f"{kind} padded={padded} rank {rank}")
    virtual = step_run("gpt2", True, 3, {"data": 2}, dropout=0.1, steps=3)
    for res in per_rank:
        # the same keys on both backends; the math differs only in reduction order
        torch.testing.assert_close(torch.tensor(res["dropout"]["losses"]), torch.tensor(virtual["losses"]), **TOL)
