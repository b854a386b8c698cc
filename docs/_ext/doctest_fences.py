"""A griffe extension for the API reference: the ``>>>`` examples of a docstring become
fenced Python blocks (prompts, continuation lines and the printed output together), so
Markdown neither joins them into a paragraph nor reads ``[a]\n[b]`` as a link."""

from __future__ import annotations

from typing import Any

import griffe


def fence(text: str) -> str:
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(lines[i][len(indent):])
            i += 1
        out += [f"{indent}```python", *(indent + b for b in block), f"{indent}```"]
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        doc = getattr(obj, "docstring", None)
        if doc is not None and ">>>" in doc.value:
            doc.value = fence(doc.value)
