"""Pytree helpers over optree: dotted key paths.

A leaf is addressed by its key path joined with dots: ``params["blocks"][0]["attn"]["w"]``
is ``"blocks.0.attn.w"``. The bottom layer: it imports nothing of fsharded. Trees of
``PartitionSpec``s (spec trees as prefixes, rules tables) are ``fsharded.mesh._tree``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree

__all__ = [
    "path_str",
    "tree_flatten_with_paths",
    "tree_map_with_path",
    "get_path",
]


def path_str(path: tuple) -> str:
    """Join an optree key path into a dotted string (``()`` is the root, ``"<root>"``)."""
    return ".".join(str(k) for k in path) if path else "<root>"


def tree_flatten_with_paths(tree: Any, *, is_leaf: Callable[[Any], bool] | None = None):
    """``(paths, leaves, treespec)`` with paths as dotted strings."""
    paths, leaves, treespec = optree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [path_str(p) for p in paths], leaves, treespec


def tree_map_with_path(fn: Callable[[str, Any], Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn(path, leaf, *other_leaves)`` over ``tree`` (and trees of the same structure)."""
    return optree.tree_map_with_path(lambda p, *xs: fn(path_str(p), *xs), tree, *rest)


def get_path(tree: Any, path: str) -> Any:
    """The subtree at dotted ``path`` (``"transformer.h"``, ``"blocks.0.w"``): dict keys,
    and list/tuple indices for integer parts. A path that is not in the tree is a
    ``KeyError`` naming the first missing part and what exists there."""
    node = tree
    done: list[str] = []
    for part in path.split(".") if path else []:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            have = list(node) if isinstance(node, Mapping) else (
                f"indices 0..{len(node) - 1}" if isinstance(node, (list, tuple)) else type(node).__name__)
            at = ".".join(done) or "the root"
            raise KeyError(f"path {path!r}: no {part!r} under {at} (it has {have})")
        done.append(part)
    return node
