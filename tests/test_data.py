"""Token sources (stdlib corpus, text file, nanoGPT .bin) and deterministic, resumable batches."""

from __future__ import annotations

import itertools
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.data import (
    Batches,
    Tokens,
    check_batch_size,
    load_tokens,
    stdlib_corpus,
    text_file,
    token_file,
)
from fsharded.models import gpt


def ramp(n=1000, dtype=np.uint16, vocab=1000):
    """Token i is i: a window's first id says where it was cut from."""
    return Tokens(np.arange(n, dtype=dtype), vocab, "ramp")


# ------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_bytes():
    a, b = stdlib_corpus(max_bytes=50_000), stdlib_corpus(max_bytes=50_000)
    assert len(a) == 50_000 and a.vocab_size == 256 and a.data.dtype == np.uint8
    assert np.array_equal(a.data, b.data)
    # Sorted path order starts at __future__.py ('_' sorts before lowercase letters).
    head = (Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_bytes()[:200]
    assert a.data[:200].tobytes() == head
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        stdlib_corpus(max_bytes=0)


def test_text_file(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("héllo\n".encode())
    t = text_file(p)
    assert t.vocab_size == 256 and t.data.tobytes() == "héllo\n".encode() and len(t) == 7
    assert str(p) in t.name


def test_token_file_roundtrip(tmp_path):
    ids = np.array([0, 5, 50256, 7, 1, 2, 3, 4, 9, 8], dtype=np.uint16)
    p = tmp_path / "train.bin"
    ids.tofile(p)
    t = token_file(p, vocab_size=50257)
    assert isinstance(t.data, np.memmap) and np.array_equal(t.data, ids)
    assert token_file(p).vocab_size == 65536
    b = Batches(t, batch_size=3, seq_len=4).batch_at(0)["tokens"]
    assert b.dtype == torch.int64 and int(b.max()) <= 50256


@pytest.mark.parametrize("make", ["missing", "empty", "dir"])
@pytest.mark.parametrize("reader", [text_file, token_file])
def test_bad_files_name_the_path(tmp_path, make, reader):
    p = tmp_path / "data.bin"
    if make == "empty":
        p.write_bytes(b"")
    elif make == "dir":
        p.mkdir()
    err = {"missing": FileNotFoundError, "empty": ValueError, "dir": ValueError}[make]
    match = {"missing": "does not exist", "empty": "is empty", "dir": "not a regular file"}[make]
    with pytest.raises(err, match=match) as e:
        reader(p)
    assert str(p) in str(e.value)


def test_corrupt_token_file(tmp_path):
    p = tmp_path / "odd.bin"
    p.write_bytes(b"\x01\x00\x02")  # 3 bytes: not whole uint16 tokens
    with pytest.raises(ValueError, match="3 bytes, not a multiple of 2") as e:
        token_file(p)
    assert str(p) in str(e.value) and "np.uint16" in str(e.value)
    p.write_bytes(np.array([1, 2, 70, 3, 4], dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"vocab_size must be an int in \[1, 65536\]"):
        token_file(p, vocab_size=70_000)
    with pytest.raises(ValueError, match="dtype must be an unsigned int"):
        token_file(p, dtype=np.float32)
    # An id beyond the tokenizer's vocabulary is caught when a batch contains it.
    small = Batches(token_file(p, vocab_size=50), batch_size=1, seq_len=4)
    with pytest.raises(ValueError, match="holds token id 70 at batch 0, but its vocab_size is 50"):
        small.batch_at(0)


def test_load_tokens_by_name(tmp_path):
    assert np.array_equal(load_tokens("stdlib:3000").data, stdlib_corpus(3000).data)
    (tmp_path / "a.txt").write_bytes(b"abc")
    np.arange(4, dtype=np.uint16).tofile(tmp_path / "a.bin")
    assert load_tokens(tmp_path / "a.txt").data.tobytes() == b"abc"
    assert load_tokens(str(tmp_path / "a.bin"), vocab_size=10).vocab_size == 10
    with pytest.raises(ValueError, match="read as text"):
        load_tokens(tmp_path / "a.txt", vocab_size=50257)
    with pytest.raises(ValueError, match="stdlib:<max_bytes>"):
        load_tokens("stdlib:lots")


# ------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------


def test_shapes_dtypes_and_contiguous_windows():
    b = Batches(ramp(), batch_size=5, seq_len=7, seed=3)
    x = b.batch_at(0)["tokens"]
    assert x.shape == (5, 8) and x.dtype == torch.int64
    assert ((x[:, 1:] - x[:, :-1]) == 1).all()
    assert int(x.max()) < 1000 and int(x.min()) >= 0


def test_deterministic_and_resumable():
    a = Batches(ramp(), batch_size=4, seq_len=8, seed=1)
    b = Batches(ramp(), batch_size=4, seq_len=8, seed=1)  # a fresh object: no hidden state
    for step in (0, 1, 17, 10**6):
        assert torch.equal(a.batch_at(step)["tokens"], b.batch_at(step)["tokens"])
    run = [x["tokens"] for x in itertools.islice(iter(a), 6)]
    resumed = [x["tokens"] for x in itertools.islice(b.iter_from(3), 3)]
    assert all(torch.equal(x, y) for x, y in zip(run[3:], resumed))
    assert not torch.equal(run[0], run[1])
    other_seed = Batches(ramp(), batch_size=4, seq_len=8, seed=2).batch_at(0)["tokens"]
    assert not torch.equal(run[0], other_seed)


def test_validation_split_is_disjoint_and_covers_the_tail():
    train = Batches(ramp(), batch_size=64, seq_len=9, val_fraction=0.2)
    val = train.validation()
    assert val.split == "val" and len(val.tokens) == 200 and len(train.tokens) == 800
    for step in range(3):
        t, v = train.batch_at(step)["tokens"], val.batch_at(step)["tokens"]
        assert int(t.max()) < 800 and int(v.min()) >= 800
    # Every window start in the split is reachable: the last one too.
    starts = torch.cat([val.batch_at(s)["tokens"][:, 0] for s in range(20)])
    assert int(starts.min()) == 800 and int(starts.max()) == 1000 - 10


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(seq_len=1000), ValueError, "has 1,000 tokens, fewer than seq_len \\+ 1 = 1001"),
        (dict(split="val"), ValueError, "needs val_fraction > 0"),
        (dict(split="test"), ValueError, "split must be 'train' or 'val'"),
        (dict(val_fraction=1.0), ValueError, r"val_fraction must be in \[0, 1\)"),
        (dict(val_fraction=0.001, split="val"), ValueError, "or a larger val_fraction"),
        (dict(batch_size=0), ValueError, "batch_size must be a positive int"),
        (dict(seed=-1), ValueError, "seed must be a non-negative int"),
        (dict(source=np.arange(100)), TypeError, "source must be a Tokens"),
    ],
)
def test_batches_errors(kwargs, err, match):
    args = dict(source=ramp(), batch_size=2, seq_len=8)
    with pytest.raises(err, match=match):
        Batches(**{**args, **kwargs})


def test_bad_step_and_tokens():
    b = Batches(ramp(), batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        b.batch_at(-1)
    with pytest.raises(ValueError, match="unsigned ints"):
        Tokens(np.arange(10, dtype=np.int64), 10, "signed")


def test_check_batch_size():
    mesh = fs.Mesh({"data": 4, "tensor": 2})
    assert check_batch_size(16, mesh) == 4
    assert check_batch_size(16, mesh, axis=("data", "tensor")) == 2
    assert check_batch_size(6, fs.Mesh({"tensor": 2})) == 6  # no data axis: not split
    assert check_batch_size(9, 3) == 3
    with pytest.raises(ValueError, match=r"batch size 10 cannot be split evenly over the 4 shards "
                                         r"of axis 'data' of Mesh\(data=4, tensor=2\); use a "
                                         r"multiple of 4 \(e.g. 8 or 12\)"):
        check_batch_size(10, mesh)


def test_batches_feed_the_model_data_parallel():
    """A global batch from the stdlib corpus, sharded over data, gives the full-batch loss."""
    cfg = gpt.GPTConfig.tiny(vocab_size=256)
    batches = Batches(stdlib_corpus(max_bytes=20_000), batch_size=4, seq_len=cfg.seq_len)
    params, batch = gpt.init(cfg, seed=0, dtype=torch.float64), batches.batch_at(0)
    mesh = fs.Mesh({"data": 2})
    check_batch_size(batches.batch_size, mesh)
    sm = fs.shard_map(lambda p, b: fs.pmean(gpt.loss(p, b), "data"), mesh=mesh,
                      in_specs=(P(), P("data")), out_specs=P())
    torch.testing.assert_close(sm(params, batch), gpt.loss(params, batch), rtol=1e-12, atol=0)
