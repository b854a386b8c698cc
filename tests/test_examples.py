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


# Each entry: a line that identifies the README block; the code run before it; text
# replacements that scale it to a test (the block is otherwise run as written); a check.
EXAMPLES = {
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
        before=_TINY_GPT + "start, steps = 0, 4\nimport tempfile\nckdir = tempfile.mkdtemp()\n",
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
    (which is CI's own command and the run the CLI tests cover)."""
    out = []
    for line, code in _blocks("bash"):
        if "pip install" in code:
            continue
        text = code.replace("\\\n", " ")
        for k, cmd in enumerate(text.splitlines()):
            cmd = cmd.split(" # ")[0].strip()
            if cmd and not cmd.startswith("#"):
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
    for name, text in _FILES.items():
        (tmp_path / name).write_text(text)
    cmds = _command_lines()
    assert any("torchrun" in c for _, c in cmds) and any("plot" in c for _, c in cmds)
    for line, cmd in cmds:
        if " plot " in f" {cmd} ":
            # The other run's metrics: the same file under the second name.
            (tmp_path / "other.jsonl").write_text((tmp_path / "metrics.jsonl").read_text())
        r = subprocess.run(_argv(cmd), capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
        assert r.returncode == 0, f"{line}: {cmd}\n{r.stderr[-3000:]}"
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
