"""Every notebook runs top to bottom in a real Jupyter kernel, and its committed outputs are
the ones the current code produces.

Each notebook is executed by ``nbclient`` in a fresh ``python3`` kernel from the notebook's
own directory; an error in any cell fails the test. The fresh outputs are then compared with
the committed ones, cell by cell: the text a cell prints (stdout) and the plain-text result
it returns must be equal, and a cell that stored a picture (``image/png``) must draw one
again (pictures are not compared byte for byte: they depend on matplotlib's version).
Warnings on stderr are not compared. A cell tagged ``volatile`` (timings) is compared by
the kinds of its outputs only.

To re-execute notebooks and store their outputs after a change:
``python tests/test_notebooks.py notebooks/02_zero_and_kernels.ipynb`` (no argument: all).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat")


def execute(path: Path):
    """The notebook at ``path`` executed in a new kernel (raises on a cell's error)."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def _summary(cell: dict) -> dict:
    """What is compared of a code cell's outputs."""
    out = {"stdout": "", "result": [], "png": False, "kinds": set()}
    for o in cell.get("outputs", []):
        kind = o["output_type"]
        if kind == "stream":
            if o.get("name") == "stdout":
                out["stdout"] += "".join(o["text"])
                out["kinds"].add("stdout")
            continue
        out["kinds"].add(kind)
        data = o.get("data", {})
        if "image/png" in data:
            out["png"] = True
            out["kinds"].add("image/png")
        if kind == "execute_result":
            out["result"].append("".join(data.get("text/plain", "")))
    return out


def differences(committed, fresh) -> list[str]:
    """The code cells whose fresh outputs differ from the committed ones, described."""
    old = [c for c in committed.cells if c.cell_type == "code"]
    new = [c for c in fresh.cells if c.cell_type == "code"]
    if len(old) != len(new):
        return [f"{len(old)} code cells committed, {len(new)} executed"]
    diffs = []
    for i, (a, b) in enumerate(zip(old, new)):
        sa, sb = _summary(a), _summary(b)
        first = "".join(a.source).splitlines()[0] if a.source else ""
        where = f"code cell {i} ({first[:50]!r})"
        if "volatile" in a.get("metadata", {}).get("tags", []):
            if sa["kinds"] != sb["kinds"]:
                diffs.append(f"{where}: outputs {sorted(sa['kinds'])} committed, {sorted(sb['kinds'])} now")
            continue
        if sa["stdout"] != sb["stdout"]:
            la, lb = sa["stdout"].splitlines(), sb["stdout"].splitlines()
            k = next((j for j, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
            diffs.append(f"{where}: printed line {k} was {la[k] if k < len(la) else '<none>'!r}, "
                         f"now {lb[k] if k < len(lb) else '<none>'!r}")
        if sa["result"] != sb["result"]:
            diffs.append(f"{where}: result was {sa['result']!r:.200}, now {sb['result']!r:.200}")
        if sa["png"] != sb["png"]:
            diffs.append(f"{where}: a picture {'committed, none drawn now' if sa['png'] else 'drawn, none committed'}")
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_kernel_and_matches_its_outputs(path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    committed = nbformat.read(path, as_version=4)
    for i, cell in enumerate(c for c in committed.cells if c.cell_type == "code"):
        assert cell.get("execution_count") is not None, f"{path.name}: code cell {i} was stored unexecuted"
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{path.name}: code cell {i} stored an error: {errors[0].get('ename')}"
    fresh = execute(path)
    diffs = differences(committed, fresh)
    assert not diffs, (f"{path.name}: the committed outputs are not what the code gives now "
                       f"(re-execute: python tests/test_notebooks.py notebooks/{path.name}):\n  "
                       + "\n  ".join(diffs))


def test_every_notebook_draws_a_picture():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert any(_summary(c)["png"] for c in nb.cells if c.cell_type == "code"), f"{path.name} has no picture"


def test_the_comparison_catches_a_changed_number():
    """The check above can fail: a notebook whose stored output differs is reported."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nb.cells = [cell]
    other = nbformat.from_dict(nbformat.v4.new_notebook())
    changed = nbformat.v4.new_code_cell("print(1)")
    changed.outputs = [nbformat.v4.new_output("stream", name="stdout", text="2\n")]
    other.cells = [changed]
    assert differences(nb, nb) == []
    assert "printed line 0 was '1', now '2'" in differences(nb, other)[0]
    changed.metadata["tags"] = ["volatile"]
    cell.metadata["tags"] = ["volatile"]
    assert differences(nb, other) == []


if __name__ == "__main__":
    for p in [Path(a).resolve() for a in sys.argv[1:]] or NOTEBOOKS:
        t = time.perf_counter()
        nb = execute(p)
        nbformat.write(nb, p)
        print(f"{p.name}: executed and written in {time.perf_counter() - t:.1f} s")
