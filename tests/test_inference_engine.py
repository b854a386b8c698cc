"""Continuous batching (``fs.inference.Engine``) over the paged cache: every request gets
what it gets alone (``generate`` on its prompt), whatever the step budget, the arrivals,
the pages and preemptions; prompt chunks mix with decodes; pages follow the live tokens;
and ``fsharded serve`` answers JSON lines and HTTP requests with the same tokens."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import urllib.request

import pytest
import torch

import fsharded as fs
from fsharded.models import gpt
from fsharded.models._gpt_config import MoEConfig

MOE = MoEConfig(experts=4, top_k=2, every=2)
MODELS = {
    "learned": dict(),
    "rotary, grouped-query": dict(positions="rotary", n_kv_heads=2, tied_embeddings=False),
    "mixture of experts": dict(moe=MOE),
}


def trace(n: int = 12, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1-29 tokens and 1-19 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(1, 30, (n,), generator=g)]
    return prompts, [int(k) for k in torch.randint(1, 20, (n,), generator=g)]


def model(name: str) -> dict:
    # init_std 0.2: logits far apart, as a trained model's are (a near-tie could flip with the
    # order of fp32 sums, which differs between a chunked prefill and a whole one)
    return gpt.init(gpt.GPTConfig.tiny(vocab_size=256, seq_len=64, init_std=0.2, **MODELS[name]), 0)


def alone(params, prompts, news, moe=None, keys=None):
    return [fs.inference.generate(params, [p], n, moe=moe, **({} if keys is None else
                                  dict(key=fs.random.key(keys[i]), temperature=0.8, top_k=50))).tokens[0]
            for i, (p, n) in enumerate(zip(prompts, news))]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_request_gets_what_it_gets_alone(name):
    params, moe = model(name), (MOE if name == "mixture of experts" else None)
    prompts, news = trace()
    want = alone(params, prompts, news, moe)
    for kw in (dict(max_batch_tokens=256), dict(max_batch_tokens=16), dict(max_batch_tokens=7, max_seqs=3),
               dict(max_batch_tokens=32, pages=12, reserve=0.0), dict(max_batch_tokens=32, pages=12, reserve=1.0)):
        e = fs.inference.Engine(params, page_size=4, moe=moe, **{"max_seqs": 5, **kw})
        ids = [e.add_request(p, n) for p, n in zip(prompts, news)]
        e.run()
        assert [e.requests[i].tokens for i in ids] == want, kw
        assert e.cache.pages_used == 0 and not e.busy
        if "pages" in kw:  # 48 slots for 5 sequences of up to 47 tokens: admitted as the pages come
            # (preempted where they run out), or only where each can run to its end
            assert (e.preemptions > 0) == (kw["reserve"] == 0.0), kw
    # sampled, each with its own key
    want = alone(params, prompts, news, moe, keys=list(range(12)))
    e = fs.inference.Engine(params, max_batch_tokens=16, max_seqs=4, page_size=4, moe=moe)
    ids = [e.add_request(p, n, key=fs.random.key(i), temperature=0.8, top_k=50)
           for i, (p, n) in enumerate(zip(prompts, news))]
    e.run()
    assert [e.requests[i].tokens for i in ids] == want


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_model_through_the_engine_gets_what_transformers_gives_alone(kind):
    pytest.importorskip("transformers")
    import inference_cases as C

    model = C.hf_model(kind)
    prompts, news = trace(8, seed=2)
    e = fs.inference.Engine(model, max_batch_tokens=16, max_seqs=4, page_size=4)
    ids = [e.add_request(p, n) for p, n in zip(prompts, news)]
    e.run()
    for i, p, n in zip(ids, prompts, news):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert e.requests[i].tokens == want
    assert e.cache.k[0].shape[1:] == ((2, 16) if kind == "gpt2" else (2, 8)) and e.cache.pages_used == 0
    if kind == "gpt2":  # (learned positions: n_positions is a context)
        with pytest.raises(ValueError, match="beyond the model's context of 64"):
            fs.inference.Engine(model).add_request([1] * 60, 10)


def test_arrivals_join_the_running_batch_and_prompt_chunks_mix_with_decodes():
    params = model("learned")
    prompts, news = trace(6, seed=1)
    want = alone(params, prompts, news)
    e = fs.inference.Engine(params, max_batch_tokens=12, max_seqs=8, page_size=4)
    batches = []
    schedule = e._schedule

    def recorded():
        chunks = schedule()
        batches.append([(bool(r.tokens), k) for r, _, k in chunks])  # (decoding?, tokens) per chunk
        return chunks

    e._schedule = recorded
    ids = [e.add_request(prompts[0], news[0])]
    for p, n in zip(prompts[1:], news[1:]):
        e.step()
        ids.append(e.add_request(p, n))  # joins while the others decode
        e.step()
    e.run()
    mixed = [b for b in batches if any(dec for dec, _ in b) and any(not dec for dec, _ in b)]
    assert mixed and all(sum(k for _, k in b) <= 12 for b in batches)
    assert [e.requests[i].tokens for i in ids] == want


def test_pages_follow_the_live_tokens_and_stop_tokens_end_a_request():
    params = model("learned")
    e = fs.inference.Engine(params, max_batch_tokens=64, page_size=4, pages=64)
    a = e.add_request(list(range(10)), 8)
    b = e.add_request([5, 6], 3)
    e.step()  # both prompts prefilled: 10 and 2 tokens in ceil(10/4) + ceil(2/4) pages
    assert e.cache.pages_used == 3 + 1
    while not e.requests[b].finished:
        e.step()
    held = -(-e.requests[a].prefilled // 4)
    assert e.cache.pages_used == held  # b's page went back at once
    e.run()
    assert e.cache.pages_used == 0
    greedy = e.requests[a].tokens
    e2 = fs.inference.Engine(params, page_size=4)
    c = e2.add_request(list(range(10)), 8, stop_tokens=[greedy[2]])
    e2.run()
    cut = greedy.index(greedy[2]) + 1
    assert e2.requests[c].tokens == greedy[:cut] and e2.requests[c].stopped


def test_bad_requests_are_refused_when_added():
    params = model("learned")  # 64 learned positions
    with pytest.raises(ValueError, match=r"reserve must be in \[0, 1\], got 1.5"):
        fs.inference.Engine(params, reserve=1.5)
    e = fs.inference.Engine(params, page_size=4, pages=8)
    with pytest.raises(ValueError, match="beyond the model's context of 64 learned positions"):
        e.add_request(list(range(60)), 10)
    with pytest.raises(ValueError, match="can never fit the cache's 32 slots"):
        e.add_request(list(range(30)), 10)
    with pytest.raises(ValueError, match="outside the vocabulary of 256"):
        e.add_request([1, 256], 2)
    with pytest.raises(ValueError, match="the prompt is empty"):
        e.add_request([], 2)
    with pytest.raises(ValueError, match="top_p must be in"):
        e.add_request([1], 2, key=fs.random.key(0), top_p=0)
    assert not e.busy
    with pytest.raises(ValueError, match=r"page_size \(0\)"):
        fs.inference.Engine(params, page_size=0)


# -- fsharded serve ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from fsharded import train

    out = tmp_path_factory.mktemp("serve") / "ck"
    assert train.main(["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "3", "--set",
                       "data=stdlib:300000", "--no-compile", "--progress", "off", "--save-every", "3",
                       "--save-dir", str(out)]) == 0
    return str(out)


def _want(checkpoint, text: str, n: int) -> list[int]:
    from fsharded.tools._generate import load_model

    m = load_model(checkpoint)
    return fs.inference.generate(m.params, [list(text.encode())], n).tokens[0]


def test_serve_answers_json_lines_as_generate_does(checkpoint):
    lines = [{"id": "a", "prompt": "def f(x", "max_new_tokens": 6},
             {"id": "b", "prompt": "import o", "max_new_tokens": 4, "stream": True},
             {"id": "c", "tokens": [1, 999]},
             {"id": "e", "prompt": 123}, {"id": "f", "tokens": "123"}, {"id": "g", "prompt": "a", "stop": "50"},
             {"id": "h", "prompt": "a", "temperature": float("nan")},
             {"id": "d", "prompt": "x", "seed": 1, "temperature": 0.9}]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    r = subprocess.run([sys.executable, "-m", "fsharded", "serve", "--checkpoint", checkpoint, "--max-new-tokens", "5"],
                       input="\n".join(json.dumps(x) for x in lines) + "\nnot json\n", capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = [json.loads(x) for x in r.stdout.splitlines()]
    final = {o["id"]: o for o in out if "token" not in o}
    assert final["a"]["tokens"] == _want(checkpoint, "def f(x", 6)
    assert final["a"]["text"] == bytes(final["a"]["tokens"]).decode("utf-8", errors="replace")
    assert final["b"]["tokens"] == _want(checkpoint, "import o", 4)
    assert [o["token"] for o in out if o.get("id") == "b" and "token" in o] == final["b"]["tokens"]  # streamed
    assert "".join(o["text"] for o in out if o.get("id") == "b" and "token" in o) == final["b"]["text"]
    assert "outside the vocabulary of 256" in final["c"]["error"]
    assert '"prompt" is text' in final["e"]["error"] and '"tokens" is a list of integer' in final["f"]["error"]
    assert '"stop" is a list of integer' in final["g"]["error"] and "finite" in final["h"]["error"]
    assert len(final["d"]["tokens"]) == 5 and final["d"]["time_to_first_token_s"] <= final["d"]["latency_s"]
    assert "not JSON" in final[None]["error"]


@pytest.mark.multiprocess
def test_serve_under_torchrun_answers_as_one_process_does(checkpoint, monkeypatch, capsys):
    # 2 ranks, the model split over tensor=2: the first rank reads stdin and answers, both
    # step the engine with the same requests; the answers are the one-process server's
    # (greedy, drawn with a seed, streamed, refused), and the other rank prints nothing.
    from fsharded.testing import free_port

    lines = [{"id": "a", "prompt": "def f(x", "max_new_tokens": 6},
             {"id": "b", "prompt": "import o", "max_new_tokens": 4, "stream": True},
             {"id": "d", "prompt": "x", "seed": 1, "temperature": 0.9},
             {"id": "c", "tokens": [1, 999]}]
    text = "\n".join(json.dumps(x) for x in lines) + "\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    cmd = ["-m", "fsharded", "serve", "--checkpoint", checkpoint, "--max-new-tokens", "5", "--mesh", "tensor=2"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), *cmd], input=text, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    one = subprocess.run([sys.executable, *cmd], input=text, capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0, one.stderr[-2000:]

    def answers(out: str) -> dict:
        got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        final = {o["id"]: o for o in got if "token" not in o}
        for o in final.values():
            o.pop("time_to_first_token_s", None)
            o.pop("latency_s", None)
        return {"final": final, "streamed": [o["token"] for o in got if "token" in o]}

    ranks, alone = answers(r.stdout), answers(one.stdout)
    assert ranks == alone and len(ranks["final"]) == 4  # (each answer once: one rank writes)
    assert ranks["final"]["a"]["tokens"] == _want(checkpoint, "def f(x", 6)
    assert "outside the vocabulary" in ranks["final"]["c"]["error"]
    # One rank per tensor shard: under torchrun the mesh must match the world.
    from fsharded.tools import _serve as serve
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(serve.distributed, "initialize", lambda **kw: None)
    monkeypatch.setattr(serve.distributed, "shutdown", lambda: None)
    monkeypatch.setattr(serve.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(serve.distributed, "rank", lambda: 0)
    monkeypatch.setattr(serve.distributed, "world_size", lambda: 2)
    assert serve.main(["--checkpoint", checkpoint], prog="serve") == 2
    assert "under torchrun the model is split over the ranks: give --mesh tensor=2" in capsys.readouterr().err


def test_serve_runs_int8_weights_on_a_tensor_axis_and_sizes_its_default_cache(checkpoint, monkeypatch, capsys):
    from fsharded.inference import _engine
    from fsharded.tools import _serve as serve
    from fsharded.tools._generate import load_model

    m = load_model(checkpoint, int8=True, mesh=fs.Mesh({"tensor": 2}))  # quantized for the mesh
    want = fs.inference.generate(fs.inference.quantize(load_model(checkpoint).params, tensor=2),
                                 [list(b"def f(x")], 6).tokens[0]
    server = serve.Server(m, max_new_tokens=6, max_batch_tokens=4, max_seqs=4, page_size=8, pages=None)
    got = []
    server.submit({"prompt": "def f(x"}, got.append)
    server.close()
    server.loop()
    assert got[0]["tokens"] == want
    # the default cache within half the memory available
    ctx = m.params["pos"].shape[0]  # (learned positions)
    full = fs.inference.Engine(m.params, max_seqs=4, page_size=8).cache
    assert full.pages == 4 * ctx // 8 and fs.inference.Engine(m.params).cache_note is None
    monkeypatch.setattr(_engine, "available_memory", lambda device: (full.nbytes, "a test limit"))
    cut = fs.inference.Engine(m.params, max_seqs=4, page_size=8)
    assert cut.cache.pages == full.pages // 2 and "more than half the memory available (a test limit)" in cut.cache_note
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # (no requests: it starts, says so and ends)
    assert serve.main(["--checkpoint", checkpoint, "--max-seqs", "4", "--page-size", "8"], prog="serve") == 0
    assert f"serve: the default cache (4 sequences of {ctx} tokens) would take more" in capsys.readouterr().err


def test_serve_over_http_runs_concurrent_requests_in_one_batch(checkpoint):
    from fsharded.tools import _serve as serve
    from fsharded.tools._generate import load_model

    server = serve.Server(load_model(checkpoint), max_new_tokens=5, max_batch_tokens=64, max_seqs=8, page_size=8,
                          pages=None)
    httpd = serve.start_http(server, 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    texts = ["def ", "class A", "import sys\n", "for i in"]
    answers: dict[str, dict] = {}

    def post(text: str) -> None:
        req = urllib.request.Request(url + "/generate", data=json.dumps({"prompt": text, "max_new_tokens": 6}).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            answers[text] = json.loads(resp.read())

    try:
        threads = [threading.Thread(target=post, args=(t,)) for t in texts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in texts:
            assert answers[t]["tokens"] == _want(checkpoint, t, 6), t
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert json.loads(resp.read())["ok"] is True
        req = urllib.request.Request(url + "/generate", data=b'{"prompt": "a", "top_k": 0}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 400 and "top_k must be" in json.loads(err.value.read())["error"]
    finally:
        httpd.shutdown()
        httpd.server_close()
        server.close()
