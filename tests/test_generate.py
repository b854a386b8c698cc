"""``fsharded generate`` on checkpoints written by ``fsharded train``: the model rebuilt from
the run's record, its parameters from any training layout, the same tokens as
``fs.inference.generate`` on the checkpoint's own parameters, and clear errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import fsharded as fs
from fsharded import train
from fsharded.models import gpt
from fsharded.tools import _generate as generate

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "3", "--set", "data=stdlib:300000",
        "--no-compile", "--progress", "off", "--save-every", "3"]


def _train(tmp_path, name: str, *extra: str) -> str:
    out = tmp_path / name
    assert train.main([*TINY, "--save-dir", str(out), *extra]) == 0
    return str(out)


def _params(directory: str):
    """The checkpoint's own parameters and model state, read without the generate tool."""
    state = fs.checkpoint.load(os.path.join(directory, "step-00000003"), None, None, fs.Mesh({}))
    return state.params, state.model_state


def _generate(capsys, *args: str) -> dict:
    assert generate.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # (after a run's own output)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("gen"), "dense")


def test_generate_continues_a_text_prompt_with_the_checkpoints_weights(trained, capsys):
    res = _generate(capsys, "--checkpoint", trained, "--prompt", "def f(x", "--prompt", "import o",
                    "--max-new-tokens", "6")
    params, _ = _params(trained)
    want = fs.inference.generate(params, [list(b"def f(x"), list(b"import o")], 6)
    assert [s["tokens"] for s in res["samples"]] == want.tokens
    assert res["samples"][0]["prompt_tokens"] == list(b"def f(x") and res["step"] == 3
    assert res["samples"][1]["text"] == bytes(want.tokens[1]).decode("utf-8", errors="replace")
    assert res["checkpoint"].endswith("step-00000003")  # the save directory's newest
    assert res["decode"]["tokens"] == 5 * 2 and res["decode"]["tokens_per_s"] > 0
    # The text form prints the prompt and its continuation, then the rates.
    capsys.readouterr()
    assert generate.main(["--checkpoint", trained, "--prompt", "def f(x", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x" + bytes(want.tokens[0]).decode("utf-8", errors="replace"))
    assert "prefill: 7 tokens" in out and "decode: 5 tokens" in out


def test_sampling_takes_its_seed_and_is_reproducible(trained, capsys):
    args = ["--checkpoint", trained, "--prompt", "ab", "--max-new-tokens", "8", "--temperature", "0.9",
            "--top-p", "0.95"]
    a = _generate(capsys, *args, "--seed", "3")
    b = _generate(capsys, *args, "--seed", "3")
    c = _generate(capsys, *args, "--seed", "4")
    params, _ = _params(trained)
    want = fs.inference.generate(params, [list(b"ab")], 8, key=fs.random.key(3), temperature=0.9, top_p=0.95)
    assert a["samples"][0]["tokens"] == b["samples"][0]["tokens"] == want.tokens[0]
    assert c["samples"][0]["tokens"] != a["samples"][0]["tokens"]


@pytest.mark.parametrize("layout", [["--mesh", "data=2", "--set", "zero_stage=3"],
                                    ["--mesh", "data=1,tensor=2", "--precision", "bf16"]])
def test_a_checkpoint_of_any_training_layout_generates_from_its_full_weights(tmp_path, capsys, layout):
    d = _train(tmp_path, "run", *layout)
    params, _ = _params(d)
    res = _generate(capsys, "--checkpoint", d, "--prompt-tokens", "10,20,30", "--max-new-tokens", "5")
    assert res["samples"][0]["tokens"] == fs.inference.generate(params, [[10, 20, 30]], 5).tokens[0]
    loaded = generate.load_model(d, dtype=torch.bfloat16)
    assert loaded.params["emb"].dtype == torch.bfloat16
    torch.testing.assert_close(loaded.params["emb"].float(), params["emb"].to(torch.bfloat16).float())


def test_int8_weights_generate_what_the_quantized_model_does(trained, capsys):
    params, _ = _params(trained)
    for extra, group in (([], None), (["--group-size", "4"], 4)):
        res = _generate(capsys, "--checkpoint", trained, "--prompt", "def f(x", "--max-new-tokens", "6", "--int8",
                        *extra)
        want = fs.inference.generate(fs.inference.quantize(params, group), [list(b"def f(x")], 6)
        assert res["samples"][0]["tokens"] == want.tokens[0]
    assert generate.load_model(trained, int8=True, dtype=torch.bfloat16).params["emb"].dtype == torch.bfloat16
    res = _generate(capsys, "--checkpoint", trained, "--prompt", "def f(x", "--max-new-tokens", "6", "--int8",
                    "--compile")
    assert res["samples"][0]["tokens"] == fs.inference.generate(fs.inference.quantize(params), [list(b"def f(x")],
                                                                6).tokens[0]
    assert generate.main(["--checkpoint", trained, "--prompt", "a", "--group-size", "4"]) == 2
    assert "give --int8 with it" in capsys.readouterr().err
    assert generate.main(["--checkpoint", trained, "--prompt", "a", "--int8", "--group-size", "5"]) == 2
    assert "positive divisor of the 16 input features" in capsys.readouterr().err


def test_a_mixture_of_experts_with_routing_biases_generates_with_its_trained_biases(tmp_path, capsys):
    d = _train(tmp_path, "moe", "--set", "model.moe.experts=4", "--set", "model.moe.every=1",
               "--set", "model.moe.bias_update_rate=0.05")
    params, ms = _params(d)
    assert any(float(b.abs().max()) > 0 for b in ms["moe_bias"])  # the run moved them
    loaded = generate.load_model(d)
    assert loaded.config.moe is not None and loaded.config.moe.experts == 4
    res = _generate(capsys, "--checkpoint", d, "--prompt", "x = ", "--max-new-tokens", "5")
    want = fs.inference.generate(params, [list(b"x = ")], 5, moe=loaded.config.moe, model_state=ms)
    assert res["samples"][0]["tokens"] == want.tokens[0]


@pytest.mark.multiprocess
def test_tensor_parallel_generation_on_the_virtual_mesh_and_under_torchrun(trained, capsys):
    import subprocess
    import sys

    from fsharded.testing import free_port

    args = ["--checkpoint", trained, "--prompt", "def f(x", "--prompt", "import o", "--max-new-tokens", "6"]
    one = _generate(capsys, *args)
    virtual = _generate(capsys, *args, "--mesh", "tensor=2")
    assert [s["tokens"] for s in virtual["samples"]] == [s["tokens"] for s in one["samples"]]
    # int8 on the mesh: the tokens of the same quantization on one device (a scale per
    # output channel per shard for the row-parallel projections), virtual and on 2 ranks
    q8 = fs.inference.quantize(generate.load_model(trained).params, tensor=2)
    want = fs.inference.generate(q8, [list(b"def f(x"), list(b"import o")], 6).tokens
    assert [s["tokens"] for s in _generate(capsys, *args, "--mesh", "tensor=2", "--int8")["samples"]] == want
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "fsharded", "generate", *args, "--mesh", "tensor=2", "--int8",
                        "--json"], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # the first rank prints
    assert [s["tokens"] for s in json.loads(lines[0])["samples"]] == want
    assert generate.main([*args, "--mesh", "tensor=3"]) == 2
    assert "tensor=3 does not divide the model's query heads 4" in capsys.readouterr().err


def test_bad_input_is_named(trained, tmp_path, capsys):
    def fails(*args: str) -> str:
        assert generate.main(list(args)) == 2, args
        return capsys.readouterr().err

    assert "no such directory" in fails("--checkpoint", str(tmp_path / "nowhere"), "--prompt", "a")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "neither a checkpoint" in fails("--checkpoint", str(empty), "--prompt", "a")
    assert "outside the vocabulary of 256" in fails("--checkpoint", trained, "--prompt-tokens", "1,999")
    assert "give --prompt TEXT or --prompt-tokens" in fails("--checkpoint", trained)
    assert "--greedy takes no" in fails("--checkpoint", trained, "--prompt", "a", "--greedy", "--top-k", "3")
    # A prompt and continuation longer than the 32 learned positions.
    err = fails("--checkpoint", trained, "--prompt", "x" * 30, "--max-new-tokens", "8")
    assert "exceeds the model's context of 32 learned positions" in err
    # A checkpoint without the run's record needs the model's settings, and refuses wrong ones.
    bare = tmp_path / "bare"
    shutil.copytree(os.path.join(trained, "step-00000003"), bare)
    os.remove(bare / "job.json")
    assert "give the --preset and --set model.KEY=VALUE" in fails("--checkpoint", str(bare), "--prompt", "a")
    err = fails("--checkpoint", str(bare), "--prompt", "a", "--preset", "small")
    assert "does not fit the tree" in err and "params.blocks.0.attn.wq" in err
    params, _ = _params(trained)
    want = fs.inference.generate(params, [list(b"ab")], 4).tokens[0]
    for given in ([], ["--set", "model.seq_len=32", "--set", "model.vocab_size=256"]):
        res = _generate(capsys, "--checkpoint", str(bare), "--prompt", "ab", "--preset", "tiny", *given,
                        "--max-new-tokens", "4")
        assert res["samples"][0]["tokens"] == want and res["step"] is None
    err = fails("--checkpoint", str(bare), "--prompt", "a", "--preset", "tiny", "--set", "model.d_model=32")
    assert "params.blocks.0.attn.wq: [32, 4, 8] torch.float32 here, [16, 4, 4]" in err
    assert "write model.KEY=VALUE" in fails("--checkpoint", str(bare), "--prompt", "a", "--set", "d_model=3")


def test_the_record_rebuilds_the_config(trained):
    rec = json.load(open(os.path.join(trained, "step-00000003", "job.json")))
    cfg = gpt.GPTConfig.from_dict(rec["model"])
    assert cfg == gpt.GPTConfig.tiny(vocab_size=256, seq_len=32) and rec["encoding"] == "bytes"
    with pytest.raises(ValueError, match="unknown settings \\['d_modle'\\]"):
        gpt.GPTConfig.from_dict({**rec["model"], "d_modle": 3})


def test_a_safetensors_export_generates_as_its_checkpoint(trained, tmp_path, capsys):
    from fsharded.tools import cli

    out = str(tmp_path / "model.safetensors")
    assert cli.main(["export", os.path.join(trained, "step-00000003"), out]) == 0
    capsys.readouterr()
    cfg, enc = fs.inference.safetensors_config(out)
    assert cfg == gpt.GPTConfig.tiny(vocab_size=256, seq_len=32) and enc == "bytes"
    args = ["--prompt", "def f(x", "--prompt", "import o", "--max-new-tokens", "6"]
    want = _generate(capsys, "--checkpoint", trained, *args)
    for extra in ([], ["--mesh", "tensor=2"], ["--dtype", "bf16"]):
        got = _generate(capsys, "--checkpoint", out, *args, *extra)
        if not extra or extra[0] == "--mesh":
            assert [s["tokens"] for s in got["samples"]] == [s["tokens"] for s in want["samples"]], extra
        assert got["samples"][0]["text"] is not None and got["step"] is None
    params, _ = _params(trained)
    loaded, _ = fs.inference.load_safetensors(out)
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(loaded),
                                                 torch.utils._pytree.tree_leaves(params)))
    with pytest.raises(ValueError, match=r"shape: blocks.0.attn.wk: \[16, 4, 4\] in the file, \[32, 4, 8\]"):
        fs.inference.load_safetensors(out, gpt.GPTConfig.tiny(vocab_size=256, seq_len=32, d_model=32))
    # a file without the config (exported with its metadata left out) takes the run's preset
    bare = str(tmp_path / "bare.safetensors")
    fs.checkpoint.export_safetensors(os.path.join(trained, "step-00000003"), bare)
    assert generate.main(["--checkpoint", bare, *args]) == 2
    assert "does not record its model's settings" in capsys.readouterr().err
    got = _generate(capsys, "--checkpoint", bare, *args, "--preset", "tiny")
    assert [s["tokens"] for s in got["samples"]] == [s["tokens"] for s in want["samples"]]
