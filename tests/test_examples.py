"""Every example the README and the docs pages advertise runs, and its printed check holds: the Python blocks
(each in the namespace its prose assumes, at a test's size), the command lines, and
``python -m fsharded.demo`` on the virtual mesh and on real ranks.

A Python block of the README or of a docs page that no entry of ``EXAMPLES`` (or ``test_readme``) runs fails
``test_every_readme_python_block_is_run``: a new example gets its entry here."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import commands
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}

# Blocks test_readme.py runs (the shard_map screen, the training loop, Hugging Face), and
# test_docs.py (getting started under torchrun).
RUN_ELSEWHERE = ("def local(w, x):", "cfg = gpt.GPTConfig.small()", "transformers.LlamaConfig(",
                 "fs.distributed.initialize()  # under torchrun")  # the last: test_docs.py


# The README and the pages of the docs site: their examples are run alike.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


class _Line(int):
    """A line number that knows its file: formats as ``path:line``."""

    def __new__(cls, n: int, path: str) -> _Line:
        out = int.__new__(cls, n)
        out.path = path
        return out

    def __add__(self, k: int) -> _Line:
        return _Line(int(self) + k, self.path)

    def __format__(self, spec: str) -> str:
        return f"{self.path}:{int(self)}"


def _blocks(lang: str) -> list[tuple[_Line, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M):
            out.append((_Line(text[:m.start()].count("\n") + 1, where), m.group(1)))
    return out


# -- the namespaces the Python examples assume ------------------------------------------

_TINY_GPT = '''
import torch
import fsharded as fs
from fsharded import P
from fsharded.models import gpt
cfg = gpt.GPTConfig.tiny(vocab_size=256)
params = gpt.init(cfg, seed=0)
opt = fs.optim.adamw(1e-3)
batch = {"tokens": torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1),
                                 generator=torch.Generator().manual_seed(0))}
batches = fs.data.Batches(fs.data.load_tokens("stdlib:200000"), batch_size=8, seq_len=cfg.seq_len)
mesh = fs.Mesh({"data": 2})
step = fs.train_step(gpt.loss, opt, mesh=mesh, param_specs=fs.parallel.zero(1)(P(), params))
state = step.init(params)
'''


def _nanogpt_module() -> None:
    """``from model import GPT, GPTConfig``: karpathy/nanoGPT's model.py, whose classes
    ``tests/model_zoo.py`` reproduces."""
    import model_zoo

    mod = types.ModuleType("model")
    mod.GPT, mod.GPTConfig = model_zoo.GPT, model_zoo.GPTConfig
    sys.modules["model"] = mod


def _check_nanogpt(ns: dict, out: str) -> None:
    # The block prints what its comment says it prints, and the trained weights went back.
    assert out.strip() == "transformer.h | {'lm_head.weight': 'transformer.wte.weight'}"
    import optree

    import fsharded as fs

    trained = ns["step"].params(ns["state"])
    back = fs.nn.functional(ns["model"]).params  # what load_into wrote into the module
    for a, b in zip(optree.tree_leaves(trained), optree.tree_leaves(back), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(back["transformer"]["wte"]["weight"], ns["initial_head"])  # it trained


def _check_tp(ns: dict, out: str) -> None:
    # The planned step trains the model it was given: its loss equals the plain module's on
    # the first batch, and the loop ran every batch.
    assert int(ns["state"].step) == len(ns["loader"])
    b = ns["loader"][0]
    m0 = ns["model0"]
    torch.testing.assert_close(ns["first_loss"], ns["loss"](m0(b["x"]), b["y"]).detach(),
                               rtol=1e-5, atol=1e-6)


def _check_manager(ns: dict, out: str) -> None:
    # The newest checkpoint restores the state the loop ended with.
    import optree

    a, b = ns["step"].params(ns["final"]), ns["step"].params(ns["state"])
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert sorted(p.name for p in pathlib.Path(ns["ckdir"]).iterdir() if p.name.startswith("step-")) \
        == ["step-00000002", "step-00000003", "step-00000004"]


def _check_zero(ns: dict, out: str) -> None:
    # Each device holds its shard of the fp32 master weights (ZeRO-3 over data beside the
    # tensor split; leaves under zero()'s min_size stay whole) and AdamW's two moments.
    import math

    import optree

    import fsharded as fs

    mesh = ns["step"].mesh
    est = fs.estimate_memory(ns["params"], ns["plan"], ns["opt"], mesh=mesh)
    master = ns["plan"].resolve(mesh).master
    want = sum(4 * x.numel() // math.prod(mesh.shape[a] for a in s.axes) for x, s in zip(
        optree.tree_leaves(ns["params"]), fs.mesh._tree.broadcast_prefix(master, ns["params"])))
    assert est.master == want and est.optimizer >= 2 * want
    assert want < 4 * sum(x.numel() for x in optree.tree_leaves(ns["params"])) / 2
    assert "peak" in out


def _check_memory(ns: dict, out: str) -> None:
    assert ns["mem"].peak_of(("parameters", "gradients", "optimizer state")) > 0
    assert "peak" in out


def _check_pictures(ns: dict, out: str) -> None:
    tl = pathlib.Path(ns["tmp"]) / "timeline.json"
    assert tl.exists() and json.loads(tl.read_text())


def _page_block(page: str, lang: str, i: int = 0) -> str:
    """The ``i``-th ```lang block of a docs page, as the page shows it."""
    text = (ROOT / "docs" / page).read_text()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)[i]


def _check_mesh(ns: dict, out: str) -> None:
    # The printed mesh arithmetic and shard shapes are what the comments say; the stacked
    # form puts rows 4-7, columns 0-2 at (data=1, tensor=0); the error shown is the one raised.
    from fsharded import P

    lines = out.splitlines()
    assert lines[0] == "4 {'data': 1, 'tensor': 1} 2"
    assert [ln.rsplit(" ", 2)[-2:] for ln in lines[1:5]] == [["(8,", "6)"], ["(4,", "6)"], ["(4,", "3)"], ["(2,", "6)"]]
    assert torch.equal(ns["stacked"].plain()[1, 0], ns["x"][4:8, 0:3])
    assert ns["specs"]["blocks"][0] == {"w1": P(None, "tensor"), "w2": P("tensor", None)} and ns["specs"]["emb"] == P()
    assert _page_block("concepts/mesh.md", "text").strip() in out


def _check_config(ns: dict, out: str) -> None:
    # The page's TOML loaded as written, the overrides applied (the global batch re-derived
    # for the new mesh), and the error shown is the one raised.
    cfg = ns["cfg"]
    assert out.splitlines()[0] == "64" and cfg.train_batch_size == 64 and cfg.mesh == {"data": 4}
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.betas == (0.9, 0.95) and cfg.zero_stage == 3
    assert cfg.scheduler.name == "WarmupCosineLR" and cfg.scheduler.params["total_num_steps"] == 200
    assert cfg.model == {"preset": "small", "n_layers": 6} and cfg.precision == "bf16"
    assert _page_block("guides/config.md", "text").strip() in out


def _check_tensor_gpt(ns: dict, out: str) -> None:
    # Tensor x data parallel with ZeRO-1 gives the one-device loss, and the manifest holds
    # exactly two psums over tensor per block in forward and two in backward, on (B/2, T, D).
    first, second = (float(v) for v in out.splitlines()[1].split())
    assert abs(first - second) < 1e-5 * abs(second)
    cfg, man = ns["cfg"], ns["manifest"]
    act = (ns["batch"]["tokens"].shape[0] // 2, cfg.seq_len, cfg.d_model)
    for phase in ("forward", "backward"):
        psums = [e for e in man if e.op == "psum" and e.axis == "tensor" and e.phase == phase and e.shape == act]
        assert len(psums) == 2 * cfg.n_layers, (phase, man)
    assert "total over tensor" in out


def _check_pipeline_schedules(ns: dict, out: str) -> None:
    # 1F1B's bubble (p-1)/(m+p-1) and its p-r held micro-batches; the hand-written table drawn.
    from fractions import Fraction
    assert out.splitlines()[0] == f"{Fraction(3, 11)} (4, 3, 2, 1)"
    assert ns["mine"].ranks == 2 and "F0" in out.split("\n", 1)[1]


def _check_pipeline_gathers(ns: dict, out: str) -> None:
    # Each rank gathers and releases both of its chunks once; the timeline shows them.
    assert ns["plan"].peak_gathered == (2, 2)
    kinds = [a.kind for row in ns["table"].actions for a in row]
    assert kinds.count("GATHER") == kinds.count("RELEASE") == 4
    assert "4 gathers, peak stages gathered per rank [2, 2]" in out


def _check_pipeline_training(ns: dict, out: str) -> None:
    # The pipelined step's losses are accumulation's over the same micro-batches.
    first, second = (float(v) for v in out.split())
    assert abs(first - second) < 1e-5, out


def _check_tensor_plan(ns: dict, out: str) -> None:
    # The plan's specs as the comment gives them, and one pvary + one psum over tensor.
    from fsharded import P

    assert ns["mlp_plan"].specs == {"0.weight": P("tensor", None), "0.bias": P("tensor"),
                                    "2.weight": P(None, "tensor"), "2.bias": P()}
    assert ns["f"].collectives(ns["mlp_plan"].params, ns["x"]).ops() == [("pvary", "tensor"), ("psum", "tensor")]


def _check_faults(ns: dict, out: str) -> None:
    # The refused step names the step and the leaf and leaves the state as it was; the
    # skipping step advances its counters and leaves the parameters.
    assert "step 2 has loss -inf and gradient norm nan; non-finite gradients in params.w" in out
    assert int(ns["state"].step) == 1 and torch.isfinite(ns["step"].params(ns["state"])["w"]).all()
    assert out.splitlines()[-1] == "2 1"
    sk = ns["skipping"]
    assert torch.equal(sk.params(ns["s2"])["w"], sk.params(ns["s1"])["w"])


def _check_compile(ns: dict, out: str) -> None:
    # One graph captured at the first call (its compile time counted there only), and the
    # compiled loss that of the same steps run eagerly.
    import re as _re

    assert ns["step"].compiles == 1 and _re.match(r"1 graph, compiled in [0-9.]+ s, then \[0\.0, 0\.0\]", out), out
    eager = fs_train_eager(ns)
    assert abs(float(ns["metrics"]["loss"]) - eager) < 1e-5, (out, eager)


def fs_train_eager(ns: dict) -> float:
    import fsharded as fs
    from fsharded.models import gpt

    step = fs.train_step(gpt.loss, fs.optim.adamw(3e-3), clip=1.0)
    state = step.init(ns["params"])
    for _ in range(3):
        state, m = step(state, ns["batch"])
    return float(m["loss"])


def _check_generate(ns: dict, out: str) -> None:
    # Greedy is the argmax chain of the full forward; the drawn run is its key's.
    import torch

    import fsharded as fs
    from fsharded.models import gpt

    for prompt, got in zip(ns["prompts"], ns["greedy"].tokens):
        seq = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                seq.append(int(gpt.apply(ns["params"], torch.tensor([seq]), attention="einsum")[0, -1].argmax()))
        assert got == seq[len(prompt):], (prompt, got, seq)
    again = fs.inference.generate(ns["params"], ns["prompts"], max_new_tokens=6, key=fs.random.key(0),
                                  temperature=0.8, top_k=20, top_p=0.95, stop_tokens=[0])
    assert again.tokens == ns["drawn"].tokens and str(ns["greedy"].tokens) in out and "tokens/s" in out


def _check_stream(ns: dict, out: str) -> None:
    import fsharded as fs

    assert ns["out"].tokens == fs.inference.generate(ns["params"], [[5, 9, 2, 7], [3]], 6).tokens
    assert "StreamedBlocks(4 blocks" in out and ns["streamed"]["blocks"].reads == 4 * 6


def _check_engine(ns: dict, out: str) -> None:
    # each request's tokens are what generate gives its prompt alone; every page is back
    import fsharded as fs

    e, params = ns["engine"], ns["params"]
    assert e.requests[ns["a"]].tokens == fs.inference.generate(params, [[5, 9, 2, 7, 1, 8, 3, 3, 4]], 6).tokens[0]
    assert e.requests[ns["b"]].tokens == fs.inference.generate(params, [[3]], 3, key=fs.random.key(1),
                                                               temperature=0.8).tokens[0]
    assert e.cache.pages_used == 0 and out.count("Event(") == 9


def _check_hf_generate(ns: dict, out: str) -> None:
    # transformers' own generate, with its own cache, gives the same tokens
    import torch

    for prompt, got in zip([[5, 9, 2, 7], [3]], ns["out"].tokens):
        with torch.no_grad():
            want = ns["model"].generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                        pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert got == want
    assert str(ns["out"].tokens) in out


def _check_mesh_generate(ns: dict, out: str) -> None:
    assert ns["tp"].tokens == ns["one"].tokens and out.strip() == "True"
    assert len(ns["tp"].cache.k[0].shape) == 4 and ns["tp"].cache.k[0].shape[2] == 4  # (every head: one process)


def _check_int8(ns: dict, out: str) -> None:
    # Each projection is int8; the product equals the fp32 model's within the int8 rounding.
    import torch

    import fsharded as fs

    for q in (ns["q8"], ns["g8"]):
        assert isinstance(q["blocks"][1]["mlp"]["w_out"], fs.inference.Int8Weight)
    assert ns["g8"]["blocks"][0]["attn"]["wq"].group_size == 8 and ns["g8"]["emb"].dtype == torch.bfloat16
    tokens = torch.tensor([[1, 2, 3]])
    want = fs.inference.extend(ns["params"], tokens, fs.inference.KVCache.empty(ns["params"], 1, 3))
    got = fs.inference.extend(ns["q8"], tokens, fs.inference.KVCache.empty(ns["q8"], 1, 3))
    assert float((got - want).abs().max()) <= 0.05 * float(want.std()) and "Int8Weight(shape=(16, 4, 4)" in out


# Each entry: a line that identifies the README block; the code run before it; text
# replacements that scale it to a test (the block is otherwise run as written); a check.
EXAMPLES = {
    "streamed = fs.inference.stream_weights(params, \"nvme\", tempfile.mkdtemp(), prefetch=1)": dict(
        before="", replace={}, check=_check_stream),
    "engine = fs.inference.Engine(params, max_batch_tokens=32, max_seqs=8, page_size=4)": dict(
        before="", replace={}, check=_check_engine),
    "out = fs.inference.generate(model, [[5, 9, 2, 7], [3]], max_new_tokens=6)": dict(
        before="", replace={}, check=_check_hf_generate),
    "tp = fs.inference.generate(params, prompts, max_new_tokens=6, mesh=fs.Mesh(": dict(
        before="", replace={}, check=_check_mesh_generate),
    "q8 = fs.inference.quantize(params)": dict(before="", replace={}, check=_check_int8),
    "greedy = fs.inference.generate(params, prompts, max_new_tokens=6)": dict(
        before="", replace={}, check=_check_generate),
    # (through the captured graph as it is, torch.compile's "eager" backend: Inductor's
    # compile of the same step is test_compile's, and takes half a minute on 2 cores)
    "step = fs.train_step(gpt.loss, fs.optim.adamw(3e-3), clip=1.0, compile=True)": dict(
        before="", replace={"compile=True": 'compile="eager"'}, check=_check_compile),
    "from model import GPT, GPTConfig": dict(
        before="import tests_examples_hooks as H; H.nanogpt()",
        replace={"fm = fs.nn.functional(model)":
                 "fm = fs.nn.functional(model)\ninitial_head = model.transformer.wte.weight.detach().clone()"},
        check=_check_nanogpt),
    "tp = fs.parallel.tensor.plan(": dict(
        before='''
import copy, torch
import fsharded as fs
import model_zoo
model = model_zoo.llama(seed=0)
model0 = copy.deepcopy(model)
def loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
g = torch.Generator().manual_seed(0)
loader = [{"x": t[:, :-1], "y": t[:, 1:]} for t in
          (torch.randint(0, model.config.vocab_size, (4, 17), generator=g) for _ in range(2))]
''',
        replace={"state, m = step(state, b)": "state, m = step(state, b)\n"
                 "        first_loss = m['loss'] if int(state.step) == 1 else first_loss",
                 "with tp.applied():": "first_loss = None\nwith tp.applied():"},
        check=_check_tp),
    "mgr = fs.checkpoint.Manager(": dict(
        before=_TINY_GPT + "steps = 4\nimport tempfile\nckdir = tempfile.mkdtemp()\n",
        replace={'Manager("ckpt", keep=3, every=100)': "Manager(ckdir, keep=3, every=1)",
                 "state = step.load(": "final = step.load("},
        check=_check_manager),
    "plan = fs.parallel.zero(3, axis=\"data\")": dict(
        before=_TINY_GPT, replace={}, check=_check_zero),
    "with fs.memory.track() as mem:": dict(before=_TINY_GPT, replace={}, check=_check_memory),
    "from fsharded import plot": dict(
        before=_TINY_GPT + '''
import tempfile
tmp = tempfile.mkdtemp()
specs = fs.parallel.zero(1)(P(), params).resolve(mesh).master
est1 = fs.estimate_memory(params, fs.parallel.zero(1)(P(), params), opt, mesh=mesh)
est3 = fs.estimate_memory(params, fs.parallel.zero(3)(P(), params), opt, mesh=mesh)
man1 = step.collectives(state, batch)
man3 = man1
''',
        replace={'tl.save("timeline.json")': 'tl.save(tmp + "/timeline.json")'},
        check=_check_pictures),
    # docs/concepts/mesh.md, docs/guides/config.md, tensor.md, faults.md
    'stacked = fs.shard(x, P("data", "tensor"), mesh)': dict(before="", replace={}, check=_check_mesh),
    'cfg = fs.config.load_config("run.toml"': dict(  # run.toml: the page's own TOML block
        before=f"import pathlib, re\n_page = pathlib.Path({str(ROOT / 'docs' / 'guides' / 'config.md')!r}).read_text()\n"
               "pathlib.Path('run.toml').write_text(re.findall(r'^```toml\\n(.*?)^```', _page, re.S | re.M)[0])\n",
        replace={}, check=_check_config),
    'cfg.check_tensor_parallel(mesh.shape["tensor"])': dict(before="", replace={}, check=_check_tensor_gpt),
    "mlp_plan = fs.parallel.tensor.plan(mlp": dict(before="", replace={}, check=_check_tensor_plan),
    # docs/guides/pipeline.md
    "plan = pipeline.check(pipeline.one_f_one_b(4, 8))": dict(before="", replace={}, check=_check_pipeline_schedules),
    "piped = fs.train_step(loss": dict(before="", replace={}, check=_check_pipeline_training),
    "table = pp.with_gathers(pp.interleaved(2, 4, 2))": dict(before="", replace={}, check=_check_pipeline_gathers),
    "skipping = fs.train_step(": dict(before="", replace={}, check=_check_faults),
    # docs/guides/train-step.md: a remat policy, the numbers of none.
    'blocks="blocks", remat="blocks:2")': dict(
        before=_TINY_GPT + '''
def _check_example(ns, out):
    import optree
    plain = fs.train_step(gpt.loss, fs.optim.adamw(3e-4), mesh=ns["mesh"], blocks="blocks")
    got, _ = ns["step"](ns["step"].init(ns["params"]), ns["batch"])
    want, _ = plain(plain.init(ns["params"]), ns["batch"])
    assert str(ns["step"].remat) == "blocks:2"
    for a, b in zip(optree.tree_leaves(got.params), optree.tree_leaves(want.params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
''',
        replace={}, check=lambda ns, out: ns["_check_example"](ns, out)),
    # docs/guides/offload.md: the moments in NVMe files, the numbers of device memory.
    'plan = fs.parallel.zero(2, offload_optimizer="nvme", nvme_path=nvme)': dict(
        before='''
def _check_example(ns, out):
    import optree
    import fsharded as fs
    from fsharded import P
    from fsharded.models import gpt
    first, second = out.splitlines()[:2]
    n = len(optree.tree_leaves(ns["params"]))
    assert "optimizer state on NVMe under" in first and second == f"{2 * n} moment files"
    ref = fs.train_step(gpt.loss, fs.optim.adamw(3e-4), mesh=fs.Mesh({"data": 2}),
                        param_specs=fs.parallel.zero(2)(P(), ns["params"]))
    want, _ = ref(ref.init(ns["params"]), {"tokens": ns["tokens"]})
    for a, b in zip(optree.tree_leaves(ns["state"]), optree.tree_leaves(want), strict=True):
        assert torch.equal(a, b)
''',
        replace={}, check=lambda ns, out: ns["_check_example"](ns, out)),
    # docs/guides/offload.md: ZenFlow; one step settled is the exact step (the cold rows'
    # update landed), bit for bit.
    "zenflow=ZenFlow(topk_ratio=0.1, select_interval=100)": dict(
        before='''
def _check_example(ns, out):
    import optree
    import fsharded as fs
    from fsharded import P
    from fsharded.models import gpt
    ref = fs.train_step(gpt.loss, fs.optim.adamw(3e-4), mesh=fs.Mesh({"data": 2}),
                        param_specs=fs.parallel.zero(2, offload_optimizer="cpu")(P(), ns["params"]))
    want, _ = ref(ref.init(ns["params"]), {"tokens": ns["tokens"]})
    for a, b in zip(optree.tree_leaves(ns["state"]), optree.tree_leaves(want), strict=True):
        assert torch.equal(a, b)
''',
        replace={}, check=lambda ns, out: ns["_check_example"](ns, out)),
    # docs/migration/deepspeed.md: a DeepSpeed config read into the step it describes.
    "fs.optim.adamw(o.lr, *o.betas, eps=o.eps": dict(
        before='''
def _check_example(ns, out):
    # The config's batch triple, precision, stage, clipping and optimizer reached the step,
    # and its first step's loss is the model's bf16 loss on that global batch.
    import fsharded as fs
    from fsharded.models import gpt
    assert out.splitlines()[0].split("#")[0].split() == ["2", "bf16", "2"]
    cfg, step, o = ns["cfg"], ns["step"], ns["o"]
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.mesh) == (16, 4, {"data": 2})
    assert (o.name, o.lr, o.weight_decay, o.betas, o.eps) == ("adamw", 3e-4, 0.1, (0.9, 0.999), 1e-8)
    assert step.accumulation == 2 and step.clip == 1.0 and step.policy == fs.precision.Policy.bf16()
    assert step.placement(ns["params"]).stage == 2 and int(ns["state"].step) == 1
    bf16 = fs.precision.cast_tree(ns["params"], torch.bfloat16)
    want = gpt.loss(bf16, {"tokens": ns["tokens"]}).float()
    # bf16 compute, micro-batches of 4 averaged: the same loss to bf16 rounding.
    torch.testing.assert_close(ns["metrics"]["loss"].float(), want, rtol=2e-2, atol=0)
''',
        replace={}, check=lambda ns, out: ns["_check_example"](ns, out)),
    # docs/migration/deepspeed.md: DeepSpeed 0.19.8's ZeRO-1 checkpoint (tests/data/deepspeed).
    'fs.checkpoint.load_deepspeed("ds_ckpt", step, params,': dict(
        before='''
import torch
import fsharded as fs
from fsharded import P
from fsharded.models import gpt
import deepspeed_cases as D
params = gpt.init(gpt.GPTConfig(**D.FIXTURE["config"]), seed=0)

def _check_example(ns, out):
    # DeepSpeed's own consolidated weights exactly, and its next step's loss from the moments.
    assert out.split("#")[0].split() == ["1", "2", "1"]
    step, state = ns["step"], ns["state"]
    got = D.by_name(step, state)
    assert all(torch.equal(got[n], w) for n, w in D.REF[1]["fp32"].items())
    _, m = step(state, {"tokens": D.FIXTURE["batches"][1]})
    assert abs(float(m["loss"]) - D.REF[1]["loss2"]) <= 1e-6 * abs(D.REF[1]["loss2"])
''',
        replace={'"ds_ckpt"': repr(str(ROOT / "tests" / "data" / "deepspeed" / "zero1"))},
        check=lambda ns, out: ns["_check_example"](ns, out)),
    # docs/migration/jax.md: ported jax.lax code, and the defaults that differ.
    "# was: from jax import lax": dict(
        before='''
def _check_example(ns, out):
    x = torch.arange(1.0, 5.0)
    assert torch.equal(ns["stacked"], x.reshape(4, 1)) and torch.equal(ns["tiled"], x)
    assert torch.equal(ns["g_sum"], x.sum().reshape(1)) and torch.equal(ns["g_own"], x)
    assert [ln.split("#")[0].strip() for ln in out.splitlines()] == [
        "torch.Size([4, 1]) torch.Size([4])", "tensor([10.]) tensor([1., 2., 3., 4.])"]
''',
        replace={}, check=lambda ns, out: ns["_check_example"](ns, out)),
    # docs/migration/fsdp2.md: an nn.Module trained at ZeRO-3 in bf16, FSDP2's settings.
    "plan = fs.parallel.zero(3, reshard_after_forward=True)(P(), fm.params)": dict(
        before=(_FSDP_NET := '''
import copy
import torch

class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.mlp = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.mlp(self.norm(x))

class Net(torch.nn.Module):
    def __init__(self, d=32, n=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

torch.manual_seed(0)
''') + '''
_g = torch.Generator().manual_seed(0)
loader = [{"x": torch.randn(8, 32, generator=_g), "y": torch.randn(8, 1, generator=_g)} for _ in range(3)]
_model0 = copy.deepcopy(Net().requires_grad_(False))
torch.manual_seed(0)

def _check_example(ns, out):
    import fsharded as fs
    from fsharded import P
    model, step, state = ns["model"], ns["step"], ns["state"]
    pl = step.placement(ns["fm"].params)
    assert ns["fm"].blocks == "layers" and pl.stage == 3 and pl.reshard_after_forward
    assert pl.params["layers"][0]["mlp"]["weight"] == P("data")  # 32 x 32: sharded
    assert int(state.step) == len(ns["loader"])
    # The first step's loss is the module's own in bf16 (the policy's parameters and compute).
    b = ns["loader"][0]
    want = torch.nn.functional.mse_loss(copy.deepcopy(_model0).bfloat16()(b["x"].bfloat16()).float(), b["y"])
    torch.testing.assert_close(ns["first_loss"], want, rtol=1e-2, atol=0)
    # load_into wrote the trained fp32 master weights into the module, and they moved.
    for (name, p), (_, p0) in zip(model.named_parameters(), _model0.named_parameters()):
        assert not torch.equal(p, p0), name
    trained = dict(zip(fs.tree_flatten_with_paths(step.params(state))[0],
                       fs.tree_flatten_with_paths(step.params(state))[1]))
    assert all(torch.equal(p.detach(), trained[n]) for n, p in model.named_parameters())
''',
        replace={"state, metrics = step(state, batch)": "state, metrics = step(state, batch)\n"
                 "    first_loss = metrics['loss'] if first_loss is None else first_loss",
                 "for batch in loader:": "first_loss = None\nfor batch in loader:"},
        check=lambda ns, out: ns["_check_example"](ns, out)),
    # docs/migration/fsdp2.md: an FSDP2-style DCP checkpoint of the module in and out.
    'fs.checkpoint.load_dcp("fsdp_ckpt", fm.params, P(), mesh)': dict(
        before=_FSDP_NET + '''
import warnings
import torch.distributed.checkpoint as dcp
import fsharded as fs
from fsharded import P
torch.manual_seed(1)
_other = Net()  # the checkpoint's weights, not the module's
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
    dcp.save(_other.state_dict(), checkpoint_id="fsdp_ckpt", no_dist=True)
torch.manual_seed(0)
model = Net()
fm = fs.nn.functional(model)
mesh = fs.Mesh({"data": 2})
def loss(params, batch):
    return torch.nn.functional.mse_loss(fm.apply(params, batch["x"]), batch["y"])
step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=mesh, blocks=fm.blocks,
                     param_specs=fs.parallel.zero(3)(P(), fm.params))

def _check_example(ns, out):
    import optree
    paths, leaves, _ = fs.tree_flatten_with_paths(ns["params"])
    sd = _other.state_dict()
    assert sorted(paths) == sorted(sd) and all(torch.equal(sd[p], x) for p, x in zip(paths, leaves))
    step, state = ns["step"], ns["state"]
    back = fs.checkpoint.load_dcp("ckpt_dcp", state, step.state_specs(state), mesh)
    for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(state), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    keys = dcp.FileSystemReader("ckpt_dcp").read_metadata().state_dict_metadata
    assert "params.layers.0.mlp.weight" in keys and "opt_state.0.mu.layers.0.mlp.weight" in keys
''',
        replace={}, check=lambda ns, out: ns["_check_example"](ns, out)),
}


def _block_for(key: str) -> tuple[int, str]:
    found = [(line, code) for line, code in _blocks("python") if key in code]
    assert len(found) == 1, f"{len(found)} README / docs blocks contain {key!r}"
    return found[0]


def test_every_readme_python_block_is_run():
    missing = [f"{line}: {code.strip().splitlines()[0]}" for line, code in _blocks("python")
               if not any(k in code for k in (*EXAMPLES, *RUN_ELSEWHERE))]
    assert not missing, "README examples that no test runs (add them to EXAMPLES):\n" + "\n".join(missing)


@pytest.mark.parametrize("key", list(EXAMPLES))
def test_readme_python_example(key, monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tests_examples_hooks", types.SimpleNamespace(nanogpt=_nanogpt_module))
    monkeypatch.delitem(sys.modules, "model", raising=False)
    ex = EXAMPLES[key]
    line, code = _block_for(key)
    for old, new in ex["replace"].items():
        assert old in code, f"{line}: the example no longer contains {old!r}"
        code = code.replace(old, new)
    ns: dict = {}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(ex["before"], "<preamble>", "exec"), ns)
        exec(compile(code, f"{line}", "exec"), ns)
    ex["check"](ns, buf.getvalue())


# -- the demo ----------------------------------------------------------------------------

_ERR = re.compile(r"parameter difference after (\d+) steps: ([0-9.e+-]+) \(ok")


def _demo_error(out: str) -> float:
    m = _ERR.search(out)
    assert m, out
    return float(m.group(2))


@pytest.mark.parametrize("data,tensor", [(2, 2), (1, 2), (2, 1), (4, 1), (1, 1)])
def test_demo_matches_the_unsharded_model(data, tensor):
    from fsharded import demo

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        demo.main(["--data", str(data), "--tensor", str(tensor)])
    # 20 SGD steps in fp32: the sharded sums round differently from the full matmuls.
    assert _demo_error(buf.getvalue()) < 1e-6
    last = [ln for ln in buf.getvalue().splitlines() if ln.startswith("step ")][-1].split()
    assert float(last[3]) == pytest.approx(float(last[5]), rel=1e-5)  # loss == unsharded


def test_demo_fails_loudly_when_its_check_fails(monkeypatch):
    from fsharded import demo

    monkeypatch.setattr(demo, "TOLERANCE", -1.0)
    with contextlib.redirect_stdout(io.StringIO()) as buf, pytest.raises(SystemExit) as e:
        demo.main(["--steps", "2"])
    assert e.value.code == 1 and "FAILED" in buf.getvalue()


@pytest.mark.multiprocess
def test_demo_under_torchrun_four_ranks():
    # The README's command, as written: torchrun --nproc_per_node 4 -m fsharded.demo
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_port", str(_port()), "-m", "fsharded.demo", "--steps", "4"],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "backend distributed" in r.stdout
    assert _demo_error(r.stdout) < 1e-6


def _port() -> int:
    from fsharded.testing import free_port

    return free_port()


# -- the README's command lines -----------------------------------------------------------

# Appended to every `fsharded train` line (later flags win): a tiny model, a few steps.
_TINY_TRAIN = ["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "3",
               "--set", "data=stdlib:300000", "--progress", "off"]
_FILES = {
    "run.toml": 'steps = 3\n[optimizer]\nlr = 2e-3\n',
    "ds_config.json": json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}),
}


def _command_lines() -> list[tuple[int, str]]:
    """(README line, command) of every command in a bash block outside the Quickstart
    (which is CI's own command and the run the CLI tests cover); a command written twice
    runs once."""
    out, seen = [], set()
    for line, code in _blocks("bash"):
        if "pip install" in code:
            continue
        text = code.replace("\\\n", " ")
        for k, cmd in enumerate(text.splitlines()):
            cmd = " ".join(cmd.split(" # ")[0].split())
            if cmd and not cmd.startswith("#") and cmd not in seen:
                seen.add(cmd)
                out.append((line + k + 1, cmd))
    return out


def _argv(cmd: str) -> list[str]:
    words = cmd.split()
    if words[0] == "fsharded":
        argv = [sys.executable, "-m", "fsharded", *words[1:]]
    elif words[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(_port()), *words[1:]]
    else:
        raise AssertionError(f"a README command this test does not know how to run: {cmd}")
    if "train" in words or "fsharded.train" in words:
        argv += _TINY_TRAIN
    return argv


@pytest.mark.multiprocess
def test_readme_command_lines_run(tmp_path):
    # Each command in a directory of its own (they write the same default paths), two at
    # a time; the plot last, over the metrics the run that names them wrote.
    cmds = _command_lines()
    assert any("torchrun" in c for _, c in cmds) and any("plot" in c for _, c in cmds)
    plots = [(line, c) for line, c in cmds if " plot " in f" {c} "]
    runs = [(line, c) for line, c in cmds if (line, c) not in plots]
    dirs = []
    for k, _ in enumerate(runs):
        dirs.append(tmp_path / f"run{k}")
        dirs[-1].mkdir()
        for name, text in _FILES.items():
            (dirs[-1] / name).write_text(text)
    results = commands.run_all([_argv(c) for _, c in runs], cwds=dirs, timeout=300, env=ENV)
    for (line, cmd), r in zip(runs, results):
        assert r.returncode == 0, f"{line}: {cmd}\n{r.stderr[-3000:]}"
    [metrics] = [d / "metrics.jsonl" for d in dirs if (d / "metrics.jsonl").exists()]
    for line, cmd in plots:
        # The other run's metrics: the same file under the second name.
        (tmp_path / "metrics.jsonl").write_text(metrics.read_text())
        (tmp_path / "other.jsonl").write_text(metrics.read_text())
        r = subprocess.run(_argv(cmd), capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
        assert r.returncode == 0, f"{line}: {cmd}\n{r.stderr[-3000:]}"
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert len(metrics.read_text().splitlines()) == 3
