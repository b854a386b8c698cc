"""Tensor- and expert-parallel generation (``generate(..., mesh=)``) against one device,
token for token, on the virtual mesh and on real gloo ranks; its collectives; its errors."""

from __future__ import annotations

import inference_cases as C
import pytest
import torch

import fsharded as fs
from fsharded.inference._sharded import MeshRunner
from fsharded.models import gpt

MESHES = {
    "learned": [{"tensor": 2}, {"data": 2, "tensor": 2}, {"data": 4}],
    "rotary, grouped-query, untied": [{"tensor": 2}, {"data": 2, "tensor": 2}],
    "llama-style": [{"tensor": 2}, {"tensor": 4}],
    "mixture of experts": [{"expert": 2}, {"expert": 2, "tensor": 2}, {"data": 2, "expert": 2}, {"expert": 4}],
}


@pytest.mark.parametrize("name", list(MESHES))
def test_every_mesh_decodes_the_one_device_tokens_on_the_virtual_mesh(name):
    ref = C.decode(name, None)
    drawn = C.decode(name, None, key=3)
    for mesh in MESHES[name]:
        got = C.decode(name, mesh)
        assert got["tokens"] == ref["tokens"], (name, mesh)
        torch.testing.assert_close(got["k0"], ref["k0"], rtol=1e-5, atol=1e-6)  # the cache too
        torch.testing.assert_close(got["kL"], ref["kL"], rtol=1e-5, atol=1e-5)
        assert C.decode(name, mesh, key=3)["tokens"] == drawn["tokens"], (name, mesh)
    assert drawn["tokens"] != ref["tokens"]


def test_one_psum_per_attention_and_per_mlp():
    params = C.params_of("llama-style")
    mesh = fs.Mesh({"tensor": 2})
    runner = MeshRunner(params, mesh)
    cache = runner.empty_cache(2, 6, torch.zeros(2, dtype=torch.int64), None)
    tokens = torch.tensor([[1, 2], [3, 4]])
    man = runner.fn.collectives(params, None, tokens, cache.k, cache.v, cache.start, 0)
    # (a pvary marks the replicated input of each split layer: no bytes forward)
    assert all(e.bytes_sent == 0 for e in man if e.op == "pvary")
    ops = [op for op in man.ops() if op[0] != "pvary"]
    assert ops == [("psum", "tensor")] * (2 * len(params["blocks"])), ops


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, name, mesh", [
    (2, "llama-style", {"tensor": 2}),
    (4, "rotary, grouped-query, untied", {"data": 2, "tensor": 2}),
    (4, "mixture of experts", {"expert": 2, "tensor": 2}),
])
def test_gloo_ranks_decode_the_one_device_tokens(world, name, mesh):
    from fsharded.testing import run_on_ranks

    ref = C.decode(name, None)
    drawn = C.decode(name, None, key=3)
    for r in run_on_ranks(C.decode, world, name, mesh):
        assert r["tokens"] == ref["tokens"]
        torch.testing.assert_close(r["k0"], ref["k0"], rtol=1e-5, atol=1e-6)
    for r in run_on_ranks(C.decode, world, name, mesh, key=3):
        assert r["tokens"] == drawn["tokens"]


INT8 = [("learned", {"tensor": 2}, None), ("llama-style", {"tensor": 4}, None),
        ("rotary, grouped-query, untied", {"data": 2, "tensor": 2}, 4), ("mixture of experts", {"expert": 2, "tensor": 2}, None)]


@pytest.mark.parametrize("name, mesh, group", INT8)
def test_int8_weights_decode_on_the_mesh_as_on_one_device(name, mesh, group):
    t = mesh["tensor"]
    ref = C.decode(name, None, int8=t, group_size=group)
    got = C.decode(name, mesh, int8=t, group_size=group)
    assert got["tokens"] == ref["tokens"]
    torch.testing.assert_close(got["k0"], ref["k0"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["kL"], ref["kL"], rtol=1e-5, atol=1e-5)  # (after layer 0's int8 sums)
    q = fs.inference.quantize(C.params_of(name), group, tensor=t)
    wo = q["blocks"][0]["attn"]["wo"]  # row-parallel: a scale per output channel per shard (or per group)
    assert wo.scales.shape[1] == (t if group is None else wo.shape[0] * wo.shape[1] // group)
    wq = q["blocks"][0]["attn"]["wq"]  # column-parallel: its scales as on one device
    assert wq.scales.shape[1] == (1 if group is None else wq.shape[0] // group)


def test_the_engine_serves_int8_weights_on_the_mesh_as_generate_on_one_device():
    q = fs.inference.quantize(C.params_of("rotary, grouped-query, untied"), tensor=2)
    want = fs.inference.generate(q, C.PROMPTS, 6).tokens
    engine = fs.inference.Engine(q, max_batch_tokens=4, mesh=fs.Mesh({"tensor": 2}))  # (prompts in chunks)
    assert engine.generate(C.PROMPTS, 6) == want


@pytest.mark.multiprocess
def test_int8_weights_decode_on_gloo_ranks_as_on_one_device():
    from fsharded.testing import run_on_ranks

    ref = C.decode("llama-style", None, int8=2)
    for r in run_on_ranks(C.decode, 2, "llama-style", {"tensor": 2}, int8=2):
        assert r["tokens"] == ref["tokens"]
        torch.testing.assert_close(r["kL"], ref["kL"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2"])
def test_the_engine_and_hugging_face_models_decode_tensor_parallel_on_the_virtual_mesh(kind):
    pytest.importorskip("transformers")
    one = C.engine_and_generate(kind, None)
    assert one["engine"] == one["generate"]
    tp = C.engine_and_generate(kind, {"tensor": 2})
    assert tp["generate"] == one["generate"] and tp["engine"] == one["generate"]


@pytest.mark.multiprocess
def test_the_engine_and_hugging_face_models_decode_tensor_parallel_on_gloo_ranks():
    pytest.importorskip("transformers")
    from fsharded.testing import run_on_ranks

    for kind, heads in (("gpt", 1), ("llama", 1), ("gpt2", 2)):  # GPT-2's plan keeps attention whole
        one = C.engine_and_generate(kind, None)
        for r in run_on_ranks(C.engine_and_generate, 2, kind, {"tensor": 2}):
            assert r["generate"] == one["generate"] and r["engine"] == one["generate"], kind
            assert r["kv"] == heads  # each rank's pages hold its key/value heads


@pytest.mark.multiprocess
def test_gloo_ranks_read_their_slices_of_a_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    from fsharded.checkpoint._common import _flatten
    from fsharded.testing import run_on_ranks

    params = C.params_of("llama-style")
    names, leaves, _ = _flatten(params)
    path = str(tmp_path / "m.safetensors")
    save_file(dict(zip(names, [x.contiguous() for x in leaves])), path)
    ref = C.decode("llama-style", None)
    assert C.decode_safetensors(path, "llama-style", {"tensor": 2})["tokens"] == ref["tokens"]  # the virtual mesh
    for r in run_on_ranks(C.decode_safetensors, 2, path, "llama-style", {"tensor": 2}):
        assert r["tokens"] == ref["tokens"] and r["wq"] == (16, 2, 4)  # half the heads read on each rank


def test_a_rank_never_reads_a_slice_that_does_not_divide():
    from fsharded.inference._safetensors import _slices

    assert _slices((8, 4), fs.P("tensor"), fs.Mesh({"tensor": 4}), {"tensor": 1}) == (slice(2, 4), slice(None))
    with pytest.raises(ValueError, match=r"dim 0 of a tensor of shape \[6, 4\] does not split"):
        _slices((6, 4), fs.P("tensor"), fs.Mesh({"tensor": 4}), {"tensor": 1})


def test_a_mesh_that_does_not_fit_is_named():
    params = gpt.init(gpt.GPTConfig.tiny(), 0)  # 4 heads, d_ff 64
    with pytest.raises(ValueError, match="tensor=3 does not divide the model's query heads 4, key/value heads 4"):
        fs.inference.generate(params, [[1]], 2, mesh=fs.Mesh({"tensor": 3}))
    with pytest.raises(ValueError, match="3 prompts do not split over the mesh's row axes {'data': 2}"):
        fs.inference.generate(params, [[1], [2], [3]], 2, mesh=fs.Mesh({"data": 2}))
    with pytest.raises(ValueError, match=r"mesh axes \['pipe'\] are not ones generation shards over"):
        fs.inference.generate(params, [[1]], 2, mesh=fs.Mesh({"pipe": 2}))
    moe = gpt.init(gpt.GPTConfig.tiny(moe=C.MOE), 0)
    with pytest.raises(ValueError, match="expert=8 does not divide the model's 4 experts"):
        fs.inference.generate(moe, [[1]] * 8, 2, moe=C.MOE, mesh=fs.Mesh({"expert": 8}))
    with pytest.raises(ValueError, match=r"blocks.0.attn.wo: its int8 scales \(1 groups of input features\) do not "
                                         r"split over tensor=2; quantize with fs.inference.quantize\(params, tensor=2\)"):
        fs.inference.generate(fs.inference.quantize(params), [[1]], 2, mesh=fs.Mesh({"tensor": 2}))
    with pytest.raises(ValueError, match="group_size 16 does not divide the 8 input features of blocks.0.attn.wo"):
        fs.inference.quantize(params, 16, tensor=2)
    with pytest.raises(NotImplementedError, match="splits the heads over a 'tensor' axis only"):
        fs.inference.Engine(params, mesh=fs.Mesh({"data": 2}))
