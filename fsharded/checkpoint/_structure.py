"""The structure of a saved tree, recorded in its checkpoint's manifest (``"structure"``),
so that a checkpoint loads back without a template as the tree it was saved from: the
same container types, keys (dotted ones included: a flat dict of parameter names, as
``named_parameters()`` and ``state_dict()`` give) and order.

Each node is a JSON value, its children in optree's flatten order (that of the manifest's
``"leaves"``; a load finds each leaf's entry by its dotted path, which must be the same
set as the manifest lists):

============================  ==================================================================
node                          recorded as
============================  ==================================================================
a leaf (tensor, JSON value)   ``"*"``
``None``                      ``null``
list, tuple, deque            ``{"list": [child, ...]}``, ``{"tuple": ...}``, ``{"deque": ..., "maxlen": n}``
dict, OrderedDict,            ``{"dict": [[key, child], ...]}`` (``"ordereddict"``, ``"defaultdict"``
defaultdict                   with its ``"factory"``), and ``"order"``: the items' insertion order
                              where it is not that one (optree flattens a dict by sorted keys)
NamedTuple, structseq         ``{"namedtuple": [...], "module": m, "qualname": q, "fields": [...]}``
                              (a structseq, as ``torch.max`` returns: also ``"structseq": true``)
any other node type           ``{"custom": [...], "module": m, "qualname": q, "paths": [...]}``
============================  ==================================================================

Keys that are str, int, float, bool or None are stored as those JSON values; another key
as ``{"key": its repr, "path": str(key)}``. A NamedTuple class is imported by module and
qualname on load; where it cannot be (a class of a script's ``__main__``, or of a function)
or its fields have changed, an equivalent ``collections.namedtuple`` is made, with a
warning. Other node types (``custom``, and dicts with other keys) are recorded so that the
paths still address the leaves, but loading them needs a template (``like=``): how to
build them is not recorded (nothing is pickled).

Checkpoints written before the structure was recorded rebuild their trees from the
leaves' dotted paths, as they always did: nested dicts, and lists where the keys are 0,
1, ..."""

from __future__ import annotations

import collections
import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded.checkpoint._common import CheckpointError, CorruptCheckpointError, _dtype

LEAF = "*"
_K = optree.PyTreeKind
_MAPS = {_K.DICT: "dict", _K.ORDEREDDICT: "ordereddict", _K.DEFAULTDICT: "defaultdict"}
_SEQS = {_K.LIST: "list", _K.TUPLE: "tuple", _K.DEQUE: "deque"}
_KINDS = ("list", "tuple", "deque", "dict", "ordereddict", "defaultdict", "namedtuple", "custom")
_SCALAR_KEYS = (str, int, float, bool)

# -- saving: a treespec as JSON ------------------------------------------------------------------


def describe(tdef: Any) -> Any:
    """The JSON description of the treespec ``tdef`` (``optree.tree_flatten``'s, with the
    dicts' insertion order it keeps)."""
    kind = tdef.kind
    if kind == _K.LEAF:
        return LEAF
    if kind == _K.NONE:
        return None
    kids = [describe(c) for c in tdef.children()]
    if kind in (_K.LIST, _K.TUPLE):
        return {_SEQS[kind]: kids}
    one = tdef.one_level()
    if kind == _K.DEQUE:
        return {"deque": kids, "maxlen": one.unflatten(range(len(kids))).maxlen}
    if kind in _MAPS:
        slots = one.unflatten(range(len(kids)))  # the keys in insertion order -> their child's index
        node: dict = {_MAPS[kind]: [[_key(k), kids[i]] for k, i in sorted(slots.items(), key=lambda kv: kv[1])]}
        order = list(slots.values())
        if order != sorted(order):
            node["order"] = order
        if kind == _K.DEFAULTDICT:
            node["factory"] = _name(slots.default_factory) if slots.default_factory is not None else None
        return node
    cls = tdef.type
    paths = [str(getattr(e, "field", e.entry)) for acc in one.accessors() for e in acc]
    if kind in (_K.NAMEDTUPLE, _K.STRUCTSEQUENCE):
        return {"namedtuple": kids, **_name(cls), "fields": paths, **({"structseq": True} if
                                                                      kind == _K.STRUCTSEQUENCE else {})}
    return {"custom": kids, **_name(cls), "paths": paths}


def _key(k: Any) -> Any:
    if k is None or type(k) in _SCALAR_KEYS:
        return k
    return {"key": repr(k)[:200], "path": str(k)}


def _name(obj: Any) -> dict:
    return {"module": str(getattr(obj, "__module__", None)),
            "qualname": str(getattr(obj, "__qualname__", type(obj).__qualname__))}


# -- reading: checks, and where a subtree's leaves are ----------------------------------------------


def _parts(node: Any) -> tuple[str, list[tuple[str, Any]]]:
    """(the node's kind, [(path segment, child)] in flatten order); ``ValueError`` naming
    what is wrong with a malformed node."""
    if isinstance(node, str) and node == LEAF:
        return "leaf", []
    if node is None:
        return "none", []
    kinds = [k for k in _KINDS if k in node] if type(node) is dict else []
    if len(kinds) != 1 or type(node[kinds[0]]) is not list:
        raise ValueError(f"a node is {str(node)[:80]!r}, not one of {LEAF!r}, null or an object with one of "
                         f"the keys {list(_KINDS)} holding a list")
    kind = kinds[0]
    kids = node[kind]
    if kind in ("list", "tuple", "deque"):
        return kind, [(str(i), c) for i, c in enumerate(kids)]
    if kind in ("dict", "ordereddict", "defaultdict"):
        if not all(type(p) is list and len(p) == 2 for p in kids):
            raise ValueError(f"a {kind}'s items are not [key, child] pairs")
        order = node.get("order")
        if order is not None and (type(order) is not list or sorted(order) != list(range(len(kids)))):
            raise ValueError(f"a {kind}'s order {str(order)[:80]} is not a permutation of its {len(kids)} items")
        return kind, [(_key_path(k), c) for k, c in kids]
    names = node.get("fields" if kind == "namedtuple" else "paths")
    if not (type(names) is list and len(names) == len(kids) and all(type(n) is str for n in names)):
        raise ValueError(f"a {kind} of {len(kids)} children has the names {str(names)[:80]}")
    if not all(type(node.get(k)) is str for k in ("module", "qualname")):
        raise ValueError(f"a {kind} without its class's module and qualname")
    return kind, list(zip(names, kids))


def _key_path(k: Any) -> str:
    if k is None or type(k) in _SCALAR_KEYS:
        return str(k)
    if type(k) is dict and type(k.get("path")) is str:
        return k["path"]
    raise ValueError(f"a dict key is {str(k)[:80]!r}")


def _walk(structure: Any, visit: Callable[[str, Any, int, int], None]) -> int:
    """Call ``visit(path, node, start, stop)`` for every node (``path``: its dotted path,
    "" at the root; its leaves are the manifest's ``start:stop``); the number of leaves."""

    def walk(node: Any, segs: list[str], start: int) -> int:
        kind, kids = _parts(node)
        stop = start + (kind == "leaf")
        for seg, child in kids:
            stop = walk(child, [*segs, seg], stop)
        visit(".".join(segs), node, start, stop)
        return stop

    return walk(structure, [], 0)


def check(structure: Any, paths: list[str]) -> str | None:
    """What is wrong with a manifest's ``structure`` given its leaves' ``paths`` (in
    order), or None: malformed, or its leaves are not the manifest's."""
    got: list[str] = []

    def leaf(path: str, node: Any, start: int, stop: int) -> None:
        if isinstance(node, str):
            got.append(path or "<root>")

    try:
        _walk(structure, leaf)
    except (ValueError, TypeError, RecursionError) as e:
        return f"its tree structure is malformed: {e}"
    if sorted(got) != sorted(paths):  # (the order is optree's, which may sort keys otherwise one day)
        only = [f"{sorted(a - b)[:3]} only {where}" for a, b, where in
                ((set(got), set(paths), "in it"), (set(paths), set(got), "in the list")) if a - b]
        return (f"its tree structure does not match its leaves: {len(got)} leaves in it, {len(paths)} listed"
                + "".join(f"; {x}" for x in only))
    return None


# -- loading: a template of the saved tree ------------------------------------------------------------


def tree_like(manifest: dict, directory: str, prefix: str = "") -> Any:
    """The subtree at dotted path ``prefix`` ("" for all) of the tree the checkpoint at
    ``directory`` (``manifest``: its ``read_manifest``) was saved from, its tensors meta
    tensors of their global shapes and dtypes, its other leaves their values."""
    entries = manifest["leaves"]
    if "structure" not in manifest:
        return _from_paths(entries, directory, prefix)
    found: list[tuple[Any, int, int]] = []

    def visit(path: str, node: Any, start: int, stop: int) -> None:
        if path == prefix:
            found.append((node, start, stop))

    _walk(manifest["structure"], visit)
    if not prefix:  # the root, visited last (a key "" has the path "" too)
        found = found[-1:]
    if len(found) > 1:
        raise CheckpointError(f"checkpoint: {directory}: {len(found)} subtrees have the path {prefix!r} (keys with "
                              f"dots spell the path of another); load it with a template (like=)")
    if not found or (found[0][1] == found[0][2] and found[0][0] is None):  # an empty container is rebuilt
        under = [e["path"] for e in entries if e["path"].startswith(prefix + ".")] if prefix else []
        if under and not found:
            raise CheckpointError(f"checkpoint: {directory} has no subtree at {prefix!r}: the leaves "
                                  f"{under[:3]} are under keys with dots; give the path of a node of the "
                                  f"tree, or load it with a template (like=)")
        raise CheckpointError(f"checkpoint: {directory} holds no leaves under {prefix!r}")
    by_path = {e["path"]: e for e in entries}
    builder = _Builder(directory, lambda path: _template_leaf(by_path[path]))
    tree = builder.build(found[0][0], prefix)
    builder.warn()
    return tree


def template(manifest: dict, directory: str, prefix: str, build: Callable[[Any], Any], api: str) -> Any:
    """``build(tree_like(manifest, directory, prefix))``; where what is rebuilt does not fit
    (``build`` raises ``ValueError`` or ``TypeError``: specs of another tree), an error
    that says what to do: pass a template, as ``api`` shows."""
    tree = tree_like(manifest, directory, prefix)
    try:
        return build(tree)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{api.split('(')[0]}: {directory}: the tree saved under {prefix or 'the root'!r} "
                              f"does not fit: {e}\n{template_hint(manifest, api)}") from e


def template_hint(manifest: dict, api: str) -> str:
    """What to do where the tree rebuilt from ``manifest`` does not fit what it is loaded
    into (``api``: how to pass a template to the function that was called)."""
    if "structure" not in manifest:
        return ("This checkpoint predates recorded tree structures: its tree was rebuilt from the leaves' "
                "dotted paths (nested dicts, lists where the keys are 0, 1, ...), which is not the tree that "
                "was saved if that had keys with dots (a flat dict of parameter names, as named_parameters() "
                f"or state_dict() gives), tuples or NamedTuples. Pass the tree as a template: {api} (meta "
                "tensors will do)")
    return ("The tree is rebuilt as it was saved: the checkpoint is of another tree than the one this expects. "
            f"Load it with what it was saved with, or pass the tree to load into as a template: {api}")


def _template_leaf(e: dict) -> Any:
    if "shape" in e:
        return torch.empty(e["shape"], dtype=_dtype(e["dtype"]), device="meta")
    return e.get("value")


_MADE: dict = {}  # (module, qualname, fields) -> the namedtuple made in its place: one class per load


class _Builder:
    """Rebuilds a node from its description, each leaf ``leaf(its dotted path)``; keeps
    the NamedTuples made in place of classes not found, for one warning."""

    def __init__(self, directory: str, leaf: Callable[[str], Any]) -> None:
        self.directory, self.leaf = directory, leaf
        self.made: dict[str, tuple[list[str], str]] = {}  # what was made alike -> (its paths, why)

    def build(self, node: Any, at: str) -> Any:
        kind, kids = _parts(node)
        if kind == "leaf":
            return self.leaf(at or "<root>")
        if kind == "none":
            return None
        built = [self.build(c, f"{at}.{seg}" if at else seg) for seg, c in kids]
        if kind == "list":
            return built
        if kind == "tuple":
            return tuple(built)
        if kind == "deque":
            return collections.deque(built, maxlen=node.get("maxlen"))
        if kind in ("dict", "ordereddict", "defaultdict"):
            keys = [k for k, _ in node[kind]]
            odd = [k["key"] for k in keys if type(k) is dict]
            if odd:
                raise self.needs(at or "<root>", f"a dict with the key {odd[0]} (not a str, int, float, bool "
                                                 f"or None)")
            order = node.get("order") or range(len(keys))
            items = [(keys[i], built[i]) for i in order]
            if kind == "defaultdict":
                return collections.defaultdict(self.factory(node.get("factory"), at or "<root>"), items)
            return (collections.OrderedDict if kind == "ordereddict" else dict)(items)
        if kind == "custom":
            raise self.needs(at or "<root>", f"a {node['module']}.{node['qualname']}, a pytree node type whose "
                                             f"construction a checkpoint does not record")
        cls = self.named(node, at or "<root>")
        return cls(built) if node.get("structseq") and not hasattr(cls, "_make") else cls(*built)

    def needs(self, at: str, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {self.directory}: {at} was saved as {what}; it cannot be rebuilt "
                               f"without a template: pass the tree as like= (fs.checkpoint.load(directory, like, "
                               f"specs, mesh), step.load(directory, like=params))")

    def named(self, node: dict, at: str) -> type:
        """The NamedTuple (or structseq) class of ``node``: imported, or one made alike."""
        fields = tuple(node["fields"])
        where = f"{node['module']}.{node['qualname']}"
        cls = self.find(node, lambda c: isinstance(c, type) and issubclass(c, tuple))
        if cls is not None:
            have = tuple(optree.structseq_fields(cls) if optree.is_structseq_class(cls) else
                         getattr(cls, "_fields", ()))
            if have == fields:
                return cls
            why = f"has the fields {list(have)} here, not {list(fields)}"
        else:
            why = self.why
        key = (node["module"], node["qualname"], fields)
        made = _MADE.get(key)
        if made is None:
            name = node["qualname"].rsplit(".", 1)[-1]
            try:
                made = collections.namedtuple(name if name.isidentifier() else "Saved", fields)
            except ValueError as e:
                raise CorruptCheckpointError(f"checkpoint: {self.directory}: the NamedTuple {where} of {at} "
                                             f"has the fields {list(fields)}, which no NamedTuple can ({e})") from None
            if len(_MADE) >= 64:
                _MADE.clear()
            _MADE[key] = made
        self.note(f"the NamedTuple {where}", at, f"{why}; it is rebuilt as collections.namedtuple("
                                                f"{made.__name__!r}, {list(fields)})")
        return made

    def factory(self, name: Any, at: str) -> Any:
        """A defaultdict's default factory: imported, else None (with a warning)."""
        if name is None:
            return None
        if type(name) is not dict or not all(type(name.get(k)) is str for k in ("module", "qualname")):
            raise CorruptCheckpointError(f"checkpoint: {self.directory}: the defaultdict at {at} has the "
                                         f"factory {str(name)[:80]!r}, not a module and qualname")
        found = self.find(name, callable)
        if found is None:
            self.note(f"a defaultdict whose factory is {name['module']}.{name['qualname']}", at,
                      f"{self.why}; it is rebuilt with no default factory")
        return found

    def note(self, what: str, at: str, why: str) -> None:
        self.made.setdefault(what, ([], why))[0].append(at)

    def find(self, node: dict, fits: Callable[[Any], bool]) -> Any:
        """The object at ``node``'s module and qualname where importing it gives one that
        ``fits``, else None (``self.why`` says why). A module not yet imported is imported:
        an installed module's code, not the checkpoint's, runs."""
        module, qualname = node["module"], node["qualname"]
        self.why = None
        if "<locals>" in qualname.split("."):
            self.why = "was defined inside a function, where no load can find it"
            return None
        try:
            obj = sys.modules.get(module) or importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except Exception as e:  # noqa: BLE001 - any failure to import means: not found here
            self.why = f"cannot be found here ({type(e).__name__}: {e})"
            return None
        if not fits(obj):
            self.why = f"is a {type(obj).__name__} here"
            return None
        return obj

    def warn(self) -> None:
        for what, (paths, why) in self.made.items():
            shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            warnings.warn(f"checkpoint: {self.directory}: {shown} {'was' if len(paths) == 1 else 'were'} saved as "
                          f"{what}, which {why}. Pass the tree as like= to load into the class itself",
                          stacklevel=4)


def _from_paths(entries: list, directory: str, prefix: str) -> Any:
    """A checkpoint without a recorded structure: the tree nested from the dotted paths."""
    root: dict = {}
    pre = prefix + "." if prefix else ""
    for e in entries:
        if not e["path"].startswith(pre):
            continue
        keys = e["path"][len(pre):].split(".")
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = _template_leaf(e)
    if not root:
        raise CheckpointError(f"checkpoint: {directory} holds no leaves under {prefix!r}")

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(range(len(node))):
            return [build(node[str(i)]) for i in range(len(node))]
        return {k: build(v) for k, v in node.items()}

    return build(root)
