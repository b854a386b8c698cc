"""The README's shard_map example runs and prints the manifest it shows."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_matches_its_printed_manifest():
    text = README.read_text()
    code = re.search(r"## shard_map in one screen\s+```python\n(.*?)```", text, re.S).group(1)
    shown = re.search(r"```python\n.*?```\s+```\n(.*?)```", text[text.index("## shard_map in one screen"):], re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    assert buf.getvalue().strip() == shown.strip()
