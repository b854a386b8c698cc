"""The docs site builds in strict mode (a broken link, a page missing from the navigation
or an API reference to a name that no longer exists fails), and the README stays short."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


# The modules the API reference documents (docs/reference/): their public functions and classes.
REFERENCE_MODULES = ["fsharded", "fsharded.lax", "fsharded.distributed", "fsharded.comm", "fsharded.parallel",
                     "fsharded.parallel.tensor", "fsharded.parallel.sequence", "fsharded.parallel.ulysses",
                     "fsharded.parallel.ring", "fsharded.parallel.moe", "fsharded.parallel.remat",
                     "fsharded.parallel.pipeline", "fsharded.optim",
                     "fsharded.nn", "fsharded.random", "fsharded.precision", "fsharded.checkpoint", "fsharded.config",
                     "fsharded.data", "fsharded.memory", "fsharded.timeline", "fsharded.kernels",
                     "fsharded.models.gpt", "fsharded.models.gpt_plans",
                     "fsharded.models.gpt_stages", "fsharded.inference"]


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert time.perf_counter() - t0 < 60
    # the API reference renders every public function and class of the documented modules
    import importlib
    import inspect
    import re

    ref = "".join(p.read_text() for p in (tmp_path / "site" / "reference").rglob("*.html"))
    ids = set(re.findall(r'id="(fsharded[\w.]*)"', ref))
    want = []
    for name in REFERENCE_MODULES:
        mod = importlib.import_module(name)
        want += [f"{name}.{a}" for a in mod.__all__  # aliases (fs.P) are their target's entry
                 if (inspect.isfunction(getattr(mod, a)) or inspect.isclass(getattr(mod, a)))
                 and getattr(mod, a).__name__ == a]
    assert len(want) > 250
    # a name documented where it is defined (a lazily exported kernel, a function that shares
    # its module's name) counts under the module that exports it
    missing = [w for w in want if w not in ids and not any(
        i.startswith(w.rsplit(".", 1)[0] + ".") and i.endswith("." + w.rsplit(".", 1)[1]) for i in ids)]
    assert not missing, f"public names missing from the API reference: {missing}"
    # its doctest examples are code blocks, not paragraphs
    assert "language-python" in (tmp_path / "site" / "reference" / "optim" / "index.html").read_text()
    # the notebooks rendered with their committed outputs, pictures included
    nb = (tmp_path / "site" / "notebooks" / "02_zero_and_kernels" / "index.html").read_text()
    assert "<img" in nb and "data:image/png;base64" in nb


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    # the notebooks are pages too (docs/notebooks links to notebooks/; their outputs rendered)
    pages += sorted(f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb"))
    missing = [p for p in pages if f": {p}" not in nav]
    assert not missing, f"docs pages not in mkdocs.yml's nav: {missing}"


def test_the_readme_is_short_and_links_its_guides():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for page in ("docs/guides/training.md", "docs/guides/zero.md", "docs/guides/checkpoints.md",
                 "docs/guides/your-model.md", "docs/benchmarks/index.md"):
        assert f"]({page})" in text, page
    # every relative link of the README names a file that exists
    import re

    links = [m.split("#")[0] for m in re.findall(r"\]\(([^)]+)\)", text) if "://" not in m]
    assert len(links) > 20
    missing = [x for x in links if not (ROOT / x).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


@pytest.mark.multiprocess
def test_the_getting_started_torchrun_example_runs(tmp_path):
    import re

    text = (ROOT / "docs" / "getting-started.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "fs.distributed.initialize()" in c)
    assert "torchrun --nproc_per_node 4 script.py" in text
    script = tmp_path / "script.py"
    # one marked line per rank, flushed at once (four processes share the pipe)
    script.write_text(code + "import torch\nprint(f'<{mesh.size} {torch.distributed.get_world_size()}>', flush=True)\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                        str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.findall(r"<(\d+) (\d+)>", r.stdout) == [("4", "4")] * 4, r.stdout


PUBLIC_MODULES = ["fsharded", "fsharded.parallel", "fsharded.optim", "fsharded.checkpoint", "fsharded.nn",
                  "fsharded.random", "fsharded.lax", "fsharded.comm", "fsharded.memory", "fsharded.data",
                  "fsharded.kernels", "fsharded.models", "fsharded.precision", "fsharded.config", "fsharded.step",
                  "fsharded.mesh", "fsharded.spmd", "fsharded.testing"]


def test_every_public_function_and_class_has_a_docstring_summary():
    import importlib
    import inspect

    missing, seen = [], 0
    for name in sorted(set(PUBLIC_MODULES) | set(REFERENCE_MODULES)):
        mod = importlib.import_module(name)
        assert hasattr(mod, "__all__"), f"{name} has no __all__: its public names are not listed"
        for attr in mod.__all__:
            obj = getattr(mod, attr)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            seen += 1
            doc = inspect.getdoc(obj) or ""
            if not doc.strip() or not doc.strip().splitlines()[0].strip():
                missing.append(f"{name}.{attr}")
    assert seen > 200
    assert not missing, f"public names without a docstring summary: {missing}"
