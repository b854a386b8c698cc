"""Run the notebooks' code cells, so an API change that breaks a notebook fails CI.

No Jupyter needed: the code cells are read with ``json`` and executed in order in one
namespace, from the notebook's own directory (as a kernel would run them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.chdir(path.parent)
    ns: dict = {"__name__": "__main__"}
    for i, cell in enumerate(_code_cells(path)):
        src = "".join(cell["source"])
        exec(compile(src, f"{path.name}[code cell {i}]", "exec"), ns)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_without_errors(path):
    """The committed notebook was executed and no cell's stored output is an error."""
    for i, cell in enumerate(_code_cells(path)):
        assert cell.get("execution_count") is not None, f"{path.name}: code cell {i} was not run"
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{path.name}: code cell {i} stored an error: {errors[0].get('ename')}"
