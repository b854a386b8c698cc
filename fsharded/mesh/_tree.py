"""Spec trees: pytrees of ``PartitionSpec``s matched against value trees.

A spec tree may be a prefix of the value tree, as in JAX: a single ``P()`` stands for
every leaf below it, and ``None`` means replicated (``broadcast_prefix``). ``rules`` builds
a spec tree from a table of parameter-path patterns. The path helpers of ``fsharded._tree``
(dotted key paths) are re-exported, so code working with spec trees imports one module.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from typing import Any

import optree

from fsharded._tree import get_path, path_str, tree_flatten_with_paths, tree_map_with_path
from fsharded.mesh._spec import PartitionSpec

__all__ = [
    "broadcast_prefix",
    "rules",
    # re-exported from fsharded._tree
    "path_str",
    "tree_flatten_with_paths",
    "tree_map_with_path",
    "get_path",
]


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def broadcast_prefix(
    specs: Any, tree: Any, *, what: str = "specs", name: Callable[[str], str] = lambda p: p
) -> list:
    """Expand a spec tree that is a prefix of ``tree`` into one spec per leaf of ``tree``.

    ``None`` in a spec tree means replicated, like ``P()``. Returns a list aligned with
    ``optree.tree_leaves(tree)``. A spec tree that does not match raises ``ValueError``
    listing every mismatch with its path (``name`` renders a dotted path for messages).
    """
    out: list = []
    errors: list[str] = []

    def walk(spec: Any, sub: Any, path: tuple) -> None:
        if _is_spec_leaf(spec):
            n = optree.tree_structure(sub).num_leaves
            out.extend([spec if spec is not None else PartitionSpec()] * n)
            return
        try:
            s_kids, _, s_keys, _ = optree.tree_flatten_one_level(spec, none_is_leaf=True)
        except ValueError:
            hint = (" (a plan of fs.parallel.zero: train_step takes it as param_specs; elsewhere pass "
                    "plan.resolve(mesh).params, the specs the parameters are kept in)"
                    if callable(getattr(spec, "resolve", None)) else "")
            errors.append(
                f"  {name(path_str(path))}: expected a PartitionSpec or a subtree, got "
                f"{type(spec).__name__} {_short(repr(spec))}{hint}"
            )
            out.extend([PartitionSpec()] * optree.tree_structure(sub).num_leaves)
            return
        try:
            v_kids, _, v_keys, _ = optree.tree_flatten_one_level(sub)
        except ValueError:
            v_kids, v_keys = None, None
        if v_kids is None or type(spec) is not type(sub) or list(s_keys) != list(v_keys):
            errors.append(
                f"  {name(path_str(path))}: {what} have {type(spec).__name__} with keys "
                f"{list(s_keys)} but the values have {type(sub).__name__}"
                + (f" with keys {list(v_keys)}" if v_keys is not None else " (a leaf)")
            )
            out.extend([PartitionSpec()] * optree.tree_structure(sub).num_leaves)
            return
        for key, s, v in zip(s_keys, s_kids, v_kids):
            walk(s, v, (*path, key))

    walk(specs, tree, ())
    if errors:
        raise ValueError(
            f"{what} do not match the value tree (a spec tree must be a prefix of it):\n"
            + "\n".join(errors)
        )
    return out


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[: n - 5] + "[...]"


def rules(
    tree: Any,
    table: Mapping[str | re.Pattern, Any],
    *,
    default: Any = None,
    allow_unmatched: bool = False,
) -> Any:
    """Build a spec tree from ``{pattern: spec}``, matched against each leaf's dotted path.

    Patterns are globs (``"blocks.*.mlp.w1"``), or regular expressions when given as a
    compiled ``re.Pattern`` or a string starting with ``"re:"``. The first matching rule
    wins; leaves that match nothing get ``default`` (``P()`` when ``None``). A pattern that
    matches no path is an error (``allow_unmatched=True`` for tables shared by models).

    >>> from fsharded import P
    >>> params = {"mlp": {"w1": torch.zeros(4, 8), "b1": torch.zeros(8)}}
    >>> rules(params, {"*.w1": P(None, "tensor")})
    {'mlp': {'b1': PartitionSpec(), 'w1': PartitionSpec(None, 'tensor')}}
    """

    compiled: list[tuple[str, Callable[[str], bool], Any]] = []
    for pat, spec in table.items():
        name = pat.pattern if isinstance(pat, re.Pattern) else pat
        if isinstance(pat, re.Pattern):
            compiled.append((name, lambda p, r=pat: r.fullmatch(p) is not None, spec))
        elif pat.startswith("re:"):
            r = re.compile(pat[3:])
            compiled.append((name, lambda p, r=r: r.fullmatch(p) is not None, spec))
        else:
            compiled.append((name, lambda p, g=pat: fnmatch.fnmatchcase(p, g), spec))
    fallback = PartitionSpec() if default is None else default
    used: set[str] = set()

    def pick(path: str, _leaf: Any) -> Any:
        for name, match, spec in compiled:
            if match(path):
                used.add(name)
                return spec
        return fallback

    out = tree_map_with_path(pick, tree)
    unused = [name for name, _, _ in compiled if name not in used]
    if unused and not allow_unmatched:
        paths = tree_flatten_with_paths(tree)[0]
        raise ValueError(
            f"rules: pattern(s) {unused} match no parameter path (a rule that matches nothing "
            f"would leave those parameters replicated). Paths look like {paths[:6]}"
            + (" ..." if len(paths) > 6 else "")
            + "; fix the pattern, or pass allow_unmatched=True for a table shared between models"
        )
    return out
