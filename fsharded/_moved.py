"""Old module names of what moved into ``fsharded.tools``, kept importable.

``import fsharded.memory`` gives ``fsharded.tools.memory`` itself (``sys.modules`` then
holds the same object under both names), imported on first use; ``from fsharded.train
import main`` and ``python -m fsharded.train`` work as they did. The modules keep their new
``__name__``, ``__spec__`` and classes' ``__module__``, so what is pickled from now on names
the new modules, and what was pickled under an old name still loads. ``fsharded`` installs
the finder when it is imported, before anything else.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from typing import Any

MOVED = {f"fsharded.{name}": f"fsharded.tools.{name}" for name in (
    "cli", "train", "_train_resume", "plot", "timeline", "visualize", "flops", "memory", "data", "demo")}


class MovedModules:
    """The meta path finder and loader of ``MOVED``'s old names."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}  # old name -> the new module's own spec, while loading

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(name)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(name, self, origin=importlib.util.find_spec(new).origin)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # The import system has set the old name's spec on the module: it keeps its own.
        module.__spec__ = self._specs.pop(module.__spec__.name)

    def get_code(self, name: str) -> Any:  # runpy: python -m fsharded.<old name>
        new = MOVED[name]
        return importlib.util.find_spec(new).loader.get_code(new)


# First on the path, so that an old name never finds a stale file; once per process.
if not any(type(f).__qualname__ == "MovedModules" and type(f).__module__ == __name__ for f in sys.meta_path):
    sys.meta_path.insert(0, MovedModules())
