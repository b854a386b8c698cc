"""ZeRO-Inference (``fs.inference.stream_weights``): the blocks in files or host memory,
read per layer with prefetch, give the in-memory tokens; only ``prefetch + 1`` blocks are
on the device at once; a damaged weights file is an error naming it."""

from __future__ import annotations

import os

import pytest
import torch

import fsharded as fs
from fsharded.models import gpt
from fsharded.models._gpt_config import MoEConfig

PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 8, 4]]
MOE = MoEConfig(experts=4, top_k=2, every=2)
MODELS = {
    "learned": dict(),
    "llama-style": dict(positions="rotary", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2,
                        tied_embeddings=False),
    "mixture of experts": dict(moe=MOE),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_streamed_weights_generate_the_in_memory_tokens(name, tmp_path):
    params = gpt.init(gpt.GPTConfig.tiny(n_layers=3, **MODELS[name]), 0)
    moe = MOE if "moe" in MODELS[name] else None
    greedy = fs.inference.generate(params, PROMPTS, 8, moe=moe)
    drawn = fs.inference.generate(params, PROMPTS, 8, moe=moe, key=fs.random.key(1), temperature=0.8)
    for tier, prefetch in (("nvme", 1), ("nvme", 2), ("cpu", 1)):
        s = fs.inference.stream_weights(params, tier, str(tmp_path) if tier == "nvme" else None, prefetch=prefetch)
        blocks = s["blocks"]
        out = fs.inference.generate(s, PROMPTS, 8, moe=moe)
        assert out.tokens == greedy.tokens, (tier, prefetch)
        assert blocks.reads == 3 * 8  # every block once per forward: the prefill and 7 decode steps
        # the logits themselves, bit for bit
        c1, c2 = fs.inference.KVCache.empty(params, 1, 4), fs.inference.KVCache.empty(s, 1, 4)
        assert torch.equal(fs.inference.extend(params, torch.tensor([[1, 2, 3]]), c1, moe=moe),
                           fs.inference.extend(s, torch.tensor([[1, 2, 3]]), c2, moe=moe))
        assert fs.inference.generate(s, PROMPTS, 8, moe=moe, key=fs.random.key(1),
                                     temperature=0.8).tokens == drawn.tokens
        assert len(blocks._buffers) == prefetch + 1  # the device holds prefetch + 1 blocks, not 3
        assert blocks.nbytes >= sum(x.numel() * x.element_size() for b in params["blocks"]
                                    for x in torch.utils._pytree.tree_leaves(b))
        if tier == "nvme":
            files = sorted(os.listdir(blocks.path))
            assert files == ["block-0000.bin", "block-0001.bin", "block-0002.bin"]
        engine = fs.inference.Engine(s, page_size=4, moe=moe)
        assert engine.generate(PROMPTS, 8) == greedy.tokens
        blocks.close()


@pytest.mark.parametrize("group_size", [None, 8])
def test_streamed_int8_weights_generate_the_in_memory_int8_tokens(group_size, tmp_path):
    # The int8 values and the scales of every projection go to the files (or host memory)
    # and come back as int8 weights: the in-memory int8 model's logits bit for bit.
    params = gpt.init(gpt.GPTConfig.tiny(n_layers=3, **MODELS["llama-style"]), 0)
    q = fs.inference.quantize(params, group_size=group_size)
    greedy = fs.inference.generate(q, PROMPTS, 8)
    int8_bytes = sum(w.nbytes for b in q["blocks"] for w in fs.tree_flatten_with_paths(b)[1]
                     if isinstance(w, fs.inference.Int8Weight))
    for tier in ("nvme", "cpu"):
        s = fs.inference.stream_weights(q, tier, str(tmp_path) if tier == "nvme" else None)
        blocks = s["blocks"]
        read = blocks[1]["attn"]["wq"]
        assert isinstance(read, fs.inference.Int8Weight) and read.q.dtype == torch.int8
        assert torch.equal(read.q, q["blocks"][1]["attn"]["wq"].q)
        assert torch.equal(read.scales, q["blocks"][1]["attn"]["wq"].scales)
        assert int8_bytes <= blocks.nbytes < 2 * int8_bytes  # (int8 and scales, not floats)
        assert fs.inference.generate(s, PROMPTS, 8).tokens == greedy.tokens, tier
        c1, c2 = fs.inference.KVCache.empty(q, 1, 4), fs.inference.KVCache.empty(s, 1, 4)
        assert torch.equal(fs.inference.extend(q, torch.tensor([[1, 2, 3]]), c1),
                           fs.inference.extend(s, torch.tensor([[1, 2, 3]]), c2))
        assert fs.inference.Engine(s, page_size=4).generate(PROMPTS, 8) == greedy.tokens
        blocks.close()


def test_a_damaged_weights_file_is_named(tmp_path):
    params = gpt.init(gpt.GPTConfig.tiny(), 0)
    s = fs.inference.stream_weights(params, "nvme", str(tmp_path))
    path = os.path.join(s["blocks"].path, "block-0001.bin")
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, 100)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match="block-0001.bin does not hold the bytes written to it"):
        fs.inference.generate(s, PROMPTS, 2)


def test_one_pass_at_a_time_and_a_pass_left_early_is_closed(tmp_path):
    params = gpt.init(gpt.GPTConfig.tiny(), 0)
    blocks = fs.inference.stream_weights(params, "nvme", str(tmp_path))["blocks"]
    first = iter(blocks)
    next(first)  # (the next block's read is in flight)
    with pytest.raises(RuntimeError, match="a pass over the blocks is already running"):
        next(iter(blocks))
    first.close()  # its read waited, the buffers free
    assert [torch.equal(b["attn"]["wq"], p["attn"]["wq"]) for b, p in zip(blocks, params["blocks"])] == [True, True]


def test_what_streaming_does_not_take_is_named(tmp_path):
    params = gpt.init(gpt.GPTConfig.tiny(), 0)
    with pytest.raises(ValueError, match="tier='nvme' needs path="):
        fs.inference.stream_weights(params, "nvme")
    with pytest.raises(ValueError, match="tier must be 'nvme' or 'cpu'"):
        fs.inference.stream_weights(params, "disk", str(tmp_path))
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        fs.inference.stream_weights(params, "cpu", prefetch=0)
    odd = {**params, "blocks": [{**b, "note": "text"} for b in params["blocks"]]}
    with pytest.raises(ValueError, match="a block holds a str; only tensors and int8 weights"):
        fs.inference.stream_weights(odd, "cpu")
    s = fs.inference.stream_weights(params, "cpu")
    for kw in (dict(compile=True), dict(mesh=fs.Mesh({"tensor": 2}))):
        with pytest.raises(NotImplementedError, match="streamed weights"):
            fs.inference.generate(s, PROMPTS, 2, **kw)
