"""``fsharded generate`` and ``fsharded serve`` on a Hugging Face model's directory
(``save_pretrained``'s, with a tokenizer trained here): the tokens of transformers' own
``generate``, on one device, on a virtual tensor=2 mesh and on 2 gloo ranks, ending at
the model's end-of-sequence token as its ``generate`` does; its linear layers as int8
(``fs.inference.quantize`` of the module) as transformers runs the same int8 module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import commands
import pytest
import torch

from fsharded.testing import free_port
from fsharded.tools import _generate as generate
from fsharded.tools import _serve as serve

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXT = ("the quick brown fox jumps over the lazy dog. a model reads its prompt and writes what follows. "
        "tokens are pieces of words; the cache keeps their keys and values.")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of 300 tokens trained on ``TEXT`` (no download)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _llama(eos: int = 1) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=0, eos_token_id=eos, initializer_range=0.2)
    return transformers.LlamaForCausalLM(cfg).eval()


def _theirs(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, up to and including its end-of-sequence token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    return out[:out.index(eos) + 1] if eos in out else out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "llama"
    tok = _tokenizer()
    model = _llama()
    ids = tok("the quick brown")["input_ids"]
    free = _theirs(model, ids, 12)  # its continuation without an end token in reach: make its 5th the end
    model.generation_config.eos_token_id = free[4]
    model.config.eos_token_id = free[4]
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _run(capsys, *args: str) -> dict:
    assert generate.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_hugging_face_directory_generates_transformers_tokens_and_stops_at_its_end_token(llama_dir, capsys):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    prompts = ["the quick brown", "a model reads"]
    args = ["--model", llama_dir, *sum((["--prompt", p] for p in prompts), []), "--max-new-tokens", "10"]
    res = _run(capsys, *args)
    want = [_theirs(model, tok(p)["input_ids"], 10) for p in prompts]
    assert [s["tokens"] for s in res["samples"]] == want
    first = res["samples"][0]
    assert len(first["tokens"]) == 5 and first["stopped"]  # the end token, kept, as transformers does
    assert first["text"] == tok.decode(first["tokens"], skip_special_tokens=True)
    assert first["prompt_tokens"] == tok("the quick brown")["input_ids"] and res["step"] is None
    assert first["full_text"] == tok.decode(first["prompt_tokens"] + first["tokens"], skip_special_tokens=True)
    # --stop none: not the end tokens either; the continuation runs to its length
    longer = _run(capsys, "--model", llama_dir, "--prompt", "the quick brown", "--max-new-tokens", "8", "--stop",
                  "none")
    assert longer["samples"][0]["tokens"][:5] == first["tokens"] and len(longer["samples"][0]["tokens"]) == 8
    assert generate.main(["--model", llama_dir, "--prompt", "the", "--stop", "none", "--stop", "3"]) == 2
    assert "give token ids, or 'none' alone" in capsys.readouterr().err
    assert generate.main(["--model", llama_dir, "--prompt", "the", "--max-new-tokens", "3"]) == 0
    assert "tokens/s (" + llama_dir + ")" in capsys.readouterr().out


def test_tensor_parallel_on_the_virtual_mesh_and_under_torchrun(llama_dir, capsys):
    args = ["--model", llama_dir, "--prompt", "the quick brown", "--prompt", "tokens are", "--max-new-tokens", "6"]
    one = [s["tokens"] for s in _run(capsys, *args)["samples"]]
    assert [s["tokens"] for s in _run(capsys, *args, "--mesh", "tensor=2")["samples"]] == one
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "fsharded", "generate", *args, "--mesh", "tensor=2", "--json"],
                       capture_output=True, text=True, timeout=240, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and [s["tokens"] for s in json.loads(lines[0])["samples"]] == one


def test_serve_answers_a_hugging_face_model_as_transformers_does(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    reqs = [{"id": "a", "prompt": "the quick brown", "max_new_tokens": 10},
            {"id": "b", "prompt": "tokens are pieces", "max_new_tokens": 6, "stream": True},
            {"id": "c", "tokens": tok("a model")["input_ids"], "max_new_tokens": 7, "stop": []}]
    meshes = ([], ["--mesh", "tensor=2"])
    runs = commands.run_all([[sys.executable, "-m", "fsharded", "serve", "--model", llama_dir, *m] for m in meshes],
                            input="\n".join(json.dumps(x) for x in reqs) + "\n", timeout=120, env=ENV)
    for mesh, r in zip(meshes, runs):
        assert r.returncode == 0, r.stderr[-2000:]
        out = [json.loads(x) for x in r.stdout.splitlines()]
        got = {o["id"]: o for o in out if "token" not in o}
        pieces = [o for o in out if "token" in o]  # streamed: the pieces add up to the text
        assert [o["token"] for o in pieces] == got["b"]["tokens"]
        assert "".join(o["text"] for o in pieces) == got["b"]["text"]
        assert got["a"]["tokens"] == _theirs(model, tok("the quick brown")["input_ids"], 10) and got["a"]["stopped"]
        assert got["a"]["text"] == tok.decode(got["a"]["tokens"], skip_special_tokens=True)
        assert got["b"]["tokens"] == _theirs(model, tok("tokens are pieces")["input_ids"], 6)
        ids = tok("a model")["input_ids"]
        with torch.no_grad():  # "stop": [] runs past the end token
            free = model.generate(torch.tensor([ids]), max_new_tokens=7, min_new_tokens=7, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert got["c"]["tokens"] == free, mesh


def test_a_directory_without_a_tokenizer_takes_token_ids_and_bad_input_is_named(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    d = str(tmp_path / "gpt2")
    model.save_pretrained(d)
    res = _run(capsys, "--model", d, "--prompt-tokens", "5,6,7", "--max-new-tokens", "4")
    assert res["samples"][0]["tokens"] == _theirs(model, [5, 6, 7], 4) and res["samples"][0]["text"] is None
    assert generate.main(["--model", d, "--prompt", "hi"]) == 2
    assert "holds no tokenizer" in capsys.readouterr().err
    assert generate.main(["--model", d, "--prompt-tokens", "5", "--int8", "--mesh", "tensor=2"]) == 2
    assert "--int8 for a Hugging Face model decodes on one device" in capsys.readouterr().err
    assert generate.main(["--model", d, "--prompt-tokens", "5", "--group-size", "8"]) == 2
    assert "give --int8 with it" in capsys.readouterr().err
    assert generate.main(["--model", d, "--prompt-tokens", "5", "--preset", "tiny"]) == 2
    assert "config.json gives its settings" in capsys.readouterr().err
    assert generate.main(["--model", d, "--prompt-tokens", "5", "--max-new-tokens", "40"]) == 2
    assert "exceeds the model's context of 32 learned positions" in capsys.readouterr().err
    assert generate.main(["--model", d, "--prompt-tokens", "5", "--mesh", "tensor=3"]) == 2
    assert "is not divisible by 3 (tensor=3)" in capsys.readouterr().err
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "no-such-model"}')
    assert generate.main(["--model", d, "--prompt-tokens", "5"]) == 2
    assert "transformers cannot load a causal LM from it" in capsys.readouterr().err
    assert serve.main(["--model", d, "--mesh", "data=2"]) == 2
    assert "tensor axis only" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_int8_layers_of_a_hugging_face_model_decode_as_transformers_runs_them(kind):
    # fs.inference.quantize(model): every nn.Linear (GPT-2: Conv1D) an Int8Linear, the tied
    # head an int8 copy. Our generate and engine on it give transformers' own greedy tokens
    # on the same int8 module (the same products); its logits stay near the float model's.
    import fsharded as fs

    torch.manual_seed(0)
    if kind == "llama":
        model = _llama()
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        cfg = transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      initializer_range=0.2)
        model = transformers.GPT2LMHeadModel(cfg).eval()
    for group_size in (None, 8):
        q = fs.inference.quantize(model, group_size=group_size)
        layers = [m for m in q.modules() if isinstance(m, fs.inference.Int8Linear)]
        assert len(layers) == (2 * 7 + 1 if kind == "llama" else 2 * 4 + 1)  # every projection and the head
        assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
        assert type(next(iter(model.modules()))) is type(q) and any(  # the model given stays float
            isinstance(m, torch.nn.Linear) for m in model.modules())
        prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
        n = 8
        ours = fs.inference.generate(q, prompts, n).tokens
        assert ours == [_theirs_free(q, p, n) for p in prompts], group_size
        assert fs.inference.Engine(q, max_seqs=2, page_size=4, pages=16).generate(prompts, n) == ours
        with torch.no_grad():
            ids = torch.tensor([prompts[0]])
            ref, got = model(ids).logits, q(ids).logits
        # the stated tolerance of int8 weights on these random two-layer models: the mean
        # logit error within 3% of the float logits' standard deviation, the largest within
        # 20% (measured 0.8-1.8% and 3.6-12.4%)
        err = (ref - got).abs()
        assert float(err.mean()) <= 0.03 * float(ref.std()) and float(err.max()) <= 0.2 * float(ref.std())
    with pytest.raises(NotImplementedError, match="int8 layers .* decode on one device"):
        fs.inference.generate(q, prompts, 2, mesh=fs.Mesh({"tensor": 2}))


def _theirs_free(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``n`` tokens, no end token."""
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(ids):].tolist()


def test_generate_and_serve_take_int8_for_a_hugging_face_directory(llama_dir, capsys):
    import fsharded as fs

    model = fs.inference.quantize(transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval())
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    res = _run(capsys, "--model", llama_dir, "--prompt", "the quick brown", "--max-new-tokens", "6", "--int8")
    assert res["samples"][0]["tokens"] == _theirs(model, tok("the quick brown")["input_ids"], 6)
    req = {"id": "a", "prompt": "tokens are pieces", "max_new_tokens": 5}
    [r] = commands.run_all([[sys.executable, "-m", "fsharded", "serve", "--model", llama_dir, "--int8"]],
                           input=json.dumps(req) + "\n", timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["tokens"] == _theirs(model, tok("tokens are pieces")["input_ids"], 5)


def test_an_int8_module_keeps_fp32_scales_through_a_cast_and_needs_no_no_grad():
    import fsharded as fs

    q = fs.inference.quantize(_llama(), dtype=torch.bfloat16)
    layer = q.model.layers[0].self_attn.q_proj
    assert layer.scales.dtype == torch.float32 and layer.q.dtype == torch.int8
    assert q.model.embed_tokens.weight.dtype == torch.bfloat16
    q.half()  # a later cast of the whole model: the scales stay fp32, the product still runs
    assert layer.scales.dtype == torch.float32
    q.float()
    ids = torch.tensor([[5, 6, 7]])
    assert q(ids).logits.shape == (1, 3, 320)  # (nothing requires grad: no torch.no_grad() needed)
    assert not any(p.requires_grad for p in q.parameters())
