"""A checkpoint's manifest and blocks files (its index), read and checked before a byte of
data is: the manifest's own checksum and each blocks file's (which the manifest records),
so that any edit of them is refused naming the file; the entries' types; that the tree
structure recorded (``checkpoint._structure``) holds exactly the leaves listed; and that each
leaf's blocks tile it exactly — in bounds, not overlapping, covering every element — each
block's bytes its box's volume times the item size, within its data file. (Checkpoints
written before the index was checksummed still get the second check.)

Also: a replace (``save(..., overwrite=True)``) interrupted between its two renames leaves
no checkpoint at its path, the old one renamed aside and the new one complete in its
temporary directory; ``settle`` puts the complete one back in place."""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import re
import warnings
import zlib
from typing import Any

import torch

from fsharded.checkpoint import _common as _ckpt_common
from fsharded.checkpoint import _structure as _ckpt_structure
from fsharded.checkpoint._common import (
    DAMAGED,
    FORMAT,
    CheckpointError,
    CorruptCheckpointError,
    _dtype,
    checksummer,
)

_MAX_CELLS = 1 << 22  # the grid a leaf's blocks cut it into; a save of fsharded's makes one cell per block


def seal(manifest: dict) -> dict:
    """``manifest`` with its checksum as its last entry: that of its JSON text without it,
    as ``json.dumps`` writes it (what ``read_manifest`` recomputes from the parsed file)."""
    kind, crc = checksummer()
    return {**manifest, "checksum": {kind: crc(json.dumps(manifest).encode())}}


def file_checksum(path: str) -> dict:
    """The checksum of a small file's bytes, as the manifest records a blocks file's."""
    kind, crc = checksummer()
    with open(path, "rb") as f:
        return {kind: crc(f.read())}


def _matches(rec: Any, data: bytes, path: str) -> bool:
    """Whether ``data`` has the checksum ``rec`` (``{"crc32c": n}`` or ``{"crc32": n}``)."""
    if isinstance(rec, dict) and isinstance(rec.get("crc32c"), int):
        if _ckpt_common._crc32c is None:
            raise CheckpointError(f"checkpoint: {path} is checksummed with CRC-32C: pip install crc32c to read it")
        return _ckpt_common._crc32c.crc32c(data) == rec["crc32c"]
    if isinstance(rec, dict) and isinstance(rec.get("crc32"), int):
        return zlib.crc32(data) == rec["crc32"]
    return False


# -- the manifest ---------------------------------------------------------------------------------


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of the checkpoint at ``directory``: its checksum verified (any edit is
    refused), its format one this fsharded reads, its entries well formed. A checkpoint
    missing because a replace was interrupted between its two renames is put back in
    place first (``settle``)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        settle(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint: no checkpoint at {directory}{_leftovers_hint(directory)}")
    return _read_manifest_file(directory)


def _read_manifest_file(directory: str) -> dict:
    mpath = os.path.join(directory, "manifest.json")
    try:
        with open(mpath, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint: {mpath} is missing: {directory} is not a complete "
                                     f"checkpoint; {DAMAGED}") from None
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"checkpoint: {mpath} is corrupt ({e}): {DAMAGED}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"checkpoint: {mpath} is corrupt (not a JSON object): {DAMAGED}")
    rec = manifest.pop("checksum", None)
    intact = rec is None or _matches(rec, json.dumps(manifest).encode(), mpath)
    version = manifest.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT:
        raise CheckpointError(
            f"checkpoint: {directory} has format {version!r}, this fsharded reads format {FORMAT} and "
            f"older; load it with a newer fsharded" + ("" if intact else
                                                       f" (but {mpath} does not match its checksum: if no "
                                                       f"newer fsharded wrote it, {DAMAGED})"))
    if not intact:
        raise CorruptCheckpointError(f"checkpoint: {mpath} does not match its checksum: it was edited or "
                                     f"damaged; {DAMAGED}")
    if rec is None and "index" in manifest:
        raise CorruptCheckpointError(f"checkpoint: {mpath} lacks its checksum: {DAMAGED}")
    _check_manifest(manifest, mpath)
    return manifest


_INT = {int}


def _nats(x: Any) -> bool:
    """Whether ``x`` is a list of non-negative ints (bools are not)."""
    return type(x) is list and set(map(type, x)) <= _INT and (not x or min(x) >= 0)


def _check_manifest(m: dict, mpath: str) -> None:
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint: {mpath}: {what}: {DAMAGED}")

    writers = m.get("writers", 1)
    if not isinstance(writers, int) or isinstance(writers, bool) or writers < 1:
        raise bad(f"'writers' is {writers!r}, not a positive int")
    leaves = m.get("leaves")
    if not isinstance(leaves, list):
        raise bad("'leaves' is not a list")
    seen = set()
    for e in leaves:
        path = e.get("path") if isinstance(e, dict) else None
        if not isinstance(path, str):
            raise bad(f"a leaf entry without a path: {e!r}")
        if path in seen:
            raise bad(f"{path!r} is listed twice")
        seen.add(path)
        if "shape" in e:
            if not _nats(e["shape"]):
                raise bad(f"the shape of {path!r} is {e['shape']!r}, not a list of non-negative ints")
            if not isinstance(e.get("dtype"), str):
                raise bad(f"{path!r} has no dtype")
            try:
                _dtype(e["dtype"])
            except CheckpointError:
                raise bad(f"{path!r} has the unknown dtype {e['dtype']!r}") from None
    index = m.get("index")
    if index is not None and not isinstance(index, dict):
        raise bad("'index' is not an object")
    if "structure" in m:  # a tree that does not hold exactly the leaves listed would load as another
        why = _ckpt_structure.check(m["structure"], [e["path"] for e in leaves])
        if why is not None:
            raise bad(why)


def describe_leaves(shapes: dict[str, list[int]]) -> str:
    """Tensors (by dotted path: global shape) in a few words: the layers and width where
    the paths show them (``...blocks.<i>...`` and an embedding ``...emb`` of [vocab,
    d_model], as the bundled GPT has), then the number of leaves and of parameters (the
    elements under ``params.`` where there is such a prefix, else all)."""
    params = {p: s for p, s in shapes.items() if p.startswith("params.")} or shapes
    words, layers = [], {}
    for p in params:
        m = re.search(r"(?:^|\.)(blocks|layers|h)\.(\d+)\.", p)
        if m:
            layers.setdefault(m.group(1), set()).add(int(m.group(2)))
    if layers:
        words.append(f"{max(len(v) for v in layers.values())} layers")
    emb = [s for p, s in params.items() if p.rsplit(".", 1)[-1] in ("emb", "wte") and len(s) == 2]
    if emb:
        words.append(f"d_model={emb[0][1]}")
    count = sum(math.prod(s) for s in params.values())
    return " ".join([*words, f"({len(shapes)} leaves, {count:,} params)"])


_SHOWN = 8  # mismatched leaves listed of each kind


def misfit_message(directory: str, saved: dict, here: dict, missing: list, extra: list, misfit: list) -> str:
    """A checkpoint of another model: one line saying what each holds, then the leaves
    that differ (a few of each kind, then a count), then what to do."""
    there = {p: e["shape"] for p, e in saved.items() if "shape" in e}
    counts = ", ".join(f"{len(x)} {what}" for x, what in ((missing, "missing"), (extra, "extra"),
                                                        (misfit, "of another shape or dtype")) if x)
    lines = [f"checkpoint: {directory} does not fit the tree it is loaded into: the checkpoint holds "
             f"{describe_leaves(there)}, the tree here {describe_leaves(here)}; {counts}:"]
    for label, items in (("missing", missing), ("extra", extra), ("shape/dtype", misfit)):
        items = sorted(items, key=lambda x: not x.startswith("params."))  # the model's own first
        lines += [f"  {label}: {x}" for x in items[:_SHOWN]]
        if len(items) > _SHOWN:
            lines.append(f"  ... and {len(items) - _SHOWN} more {label}")
    lines.append("Load it into the model it was saved from (for fsharded train: the same --preset, --config "
                 "and --set model.* options), or give a checkpoint of this model (another --save-dir or "
                 "--resume PATH).")
    return "\n".join(lines)


# -- the blocks files -----------------------------------------------------------------------------


def _blocks(directory: str, manifest: dict) -> dict[str, list[dict]]:
    """Every leaf's blocks (by dotted path) from the blocks files of the checkpoint at
    ``directory`` (``manifest``: its ``read_manifest``), each file checked against the
    checksum the manifest records for it and every leaf's blocks checked to tile it."""
    mpath = os.path.join(directory, "manifest.json")
    writers = int(manifest.get("writers", 1))
    index = manifest.get("index")
    leaves = {e["path"]: e for e in manifest["leaves"] if "shape" in e}
    sized = {path: (e["shape"], _dtype(e["dtype"]).itemsize) for path, e in leaves.items()}
    by_path: dict[str, list[dict]] = {}
    sizes: dict[str, tuple[str, int]] = {}  # data file name -> (its path, its size)
    for w in range(writers):
        name = f"blocks-{w:05d}.json"
        p = os.path.join(directory, name)
        try:
            with open(p, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint: {p} is missing (writer {w} of {writers}): "
                                         f"{DAMAGED}") from None
        if index is not None and not _matches(index.get(name), raw, p):
            raise CorruptCheckpointError(
                f"checkpoint: {p} does not match the checksum {mpath} records for it: it was edited or "
                f"damaged; {DAMAGED}")
        try:
            blocks = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"checkpoint: {p} is corrupt ({e}): {DAMAGED}") from None
        if not isinstance(blocks, list):
            raise CorruptCheckpointError(f"checkpoint: {p} is corrupt (not a JSON list): {DAMAGED}")
        for b in blocks:
            _check_block(b, p, sized, directory, sizes)
            b["blocks_file"] = p
            by_path.setdefault(b["path"], []).append(b)
    for path, e in leaves.items():
        _check_tiling(path, e, by_path.get(path, []), directory)
    return by_path


def _bad_block(p: str, path: str, start: Any, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint: {p}: the block of {path!r} at {start} {what}: {DAMAGED}")


def _check_block(b: Any, p: str, leaves: dict, directory: str, sizes: dict) -> None:
    """One block entry of blocks file ``p``: of a leaf of the manifest (``leaves``: path ->
    (shape, item size)), its box in the leaf, its bytes its box's, within its data file
    (``sizes``: data file name -> (its path, its size)), with a checksum."""
    path = b.get("path") if type(b) is dict else None
    leaf = leaves.get(path) if type(path) is str else None
    if leaf is None:
        raise CorruptCheckpointError(f"checkpoint: {p}: a block of {path!r}, which the manifest does not "
                                     f"list as a tensor: {DAMAGED}")
    shape, itemsize = leaf
    start, size, file, offset, nbytes = b.get("start"), b.get("shape"), b.get("file"), b.get("offset"), b.get("nbytes")
    bad = functools.partial(_bad_block, p, path, start)
    if not (_nats(start) and _nats(size) and len(start) == len(shape) == len(size)):
        raise bad(f"has start {start!r} and shape {size!r}, not {len(shape)} non-negative ints each "
                  f"(the leaf is {shape})")
    for s, n, d in zip(start, size, shape):
        if s + n > d:
            raise bad(f"of shape {size} reaches outside the leaf's shape {shape}")
    if not _nats([offset, nbytes]):
        raise bad(f"has offset {offset!r} and nbytes {nbytes!r}, not non-negative ints")
    want = math.prod(size) * itemsize
    if nbytes != want:
        raise bad(f"holds {nbytes} bytes, but its box {size} at {itemsize} bytes an element is {want} bytes")
    if type(b.get("crc32c")) is not int and type(b.get("crc32")) is not int:
        raise bad("has no checksum")
    known = sizes.get(file) if type(file) is str else None
    if known is None:
        if type(file) is not str or os.path.basename(file) != file or file in ("", ".", ".."):
            raise bad(f"names the data file {file!r}, not a file of the checkpoint")
        data = os.path.join(directory, file)
        try:
            known = sizes[file] = (data, os.stat(data).st_size)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint: {data} is missing (it holds {path!r}; {p}): "
                                         f"{DAMAGED}") from None
    if offset + nbytes > known[1]:
        raise CorruptCheckpointError(
            f"checkpoint: {known[0]} is truncated: {path}'s block at byte {offset} ends at byte "
            f"{offset + nbytes}, the file has {known[1]} ({p}): {DAMAGED}")


def _regular_grid(shape: list, blocks: list[dict]) -> bool:
    """Whether ``blocks`` are the cells of a grid over ``shape`` (what a save makes: each
    dim cut into contiguous pieces, one block per combination), each once: then they tile
    it exactly. Otherwise ``_check_tiling`` looks closer."""
    k = len(blocks)
    if len({tuple(b["start"]) for b in blocks}) != k:
        return False
    cells = 1
    for d, n in enumerate(shape):
        pieces = sorted({(b["start"][d], b["shape"][d]) for b in blocks})
        at = 0
        for lo, size in pieces:  # contiguous from 0 to n, one piece per start
            if lo != at or size == 0:
                return False
            at = lo + size
        if at != n:
            return False
        cells *= len(pieces)
    return cells == k


def _check_tiling(path: str, e: dict, blocks: list[dict], directory: str) -> None:
    """That the (in-bounds) ``blocks`` of leaf ``path`` cover each of its elements exactly
    once: the blocks' edges cut the leaf into a grid of cells, each block covers a box of
    cells, and each cell must be covered once. A save of fsharded's makes one cell per
    block (``_regular_grid``, checked without a tensor)."""
    shape = e["shape"]
    total = math.prod(shape)
    if total == 0 or _regular_grid(shape, blocks):
        return
    blocks = [b for b in blocks if math.prod(b["shape"])]
    files = sorted({b["blocks_file"] for b in blocks})
    where = ", ".join(files) if files else f"no blocks file of {directory}"

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint: {where}: the blocks of {path!r} {shape} {what}: {DAMAGED}")

    edges = [sorted({0, n, *(b["start"][d] for b in blocks), *(b["start"][d] + b["shape"][d] for b in blocks)})
             for d, n in enumerate(shape)]
    cuts = [[(bisect.bisect_left(edges[d], b["start"][d]), bisect.bisect_left(edges[d], b["start"][d] + b["shape"][d]))
             for d in range(len(shape))] for b in blocks]
    grid = [len(x) - 1 for x in edges]
    cells = math.prod(grid)
    if cells > _MAX_CELLS:
        raise bad(f"cut it into {cells:,} pieces, more than any save makes")
    count = torch.zeros(grid, dtype=torch.int32)
    for j, c in enumerate(cuts):
        box = count[tuple(slice(lo, hi) for lo, hi in c)]
        if bool((box > 0).any()):
            i = next(i for i in range(j) if all(a_lo < b_hi and b_lo < a_hi for (a_lo, a_hi), (b_lo, b_hi)
                                               in zip(cuts[i], c)))
            def which(b: dict) -> str:
                return f"at {b['start']} of shape {b['shape']}" + (f" ({b['blocks_file']})" if len(files) > 1 else "")

            raise bad(f"overlap: the block {which(blocks[i])} and the one {which(blocks[j])}")
        box += 1
    gaps = (count == 0).nonzero()
    if len(gaps):
        have = sum(math.prod(b["shape"]) for b in blocks)
        first = [edges[d][k] for d, k in enumerate(gaps[0].tolist())]
        raise bad(f"cover {have} of its {total} elements: none holds the element at {first}")


# -- a replace interrupted between its two renames ---------------------------------------------------


def _complete(path: str, token: str | None = None) -> bool:
    """Whether ``path`` holds a whole checkpoint (its manifest intact), of save ``token``."""
    try:
        m = _read_manifest_file(path)
    except (CheckpointError, OSError):
        return False
    return token is None or m.get("token") == token


def _newest_first(parent: str, names: list[str]) -> list[str]:
    def mtime(n: str) -> float:
        try:
            return os.stat(os.path.join(parent, n)).st_mtime
        except OSError:
            return 0.0

    return sorted(names, key=mtime, reverse=True)


def settle(directory: str | os.PathLike) -> bool:
    """Where ``directory`` is missing because a replace of it stopped between its two
    renames (``<directory>`` to ``<directory>.old-<token>``, then ``<directory>.tmp-<token>``
    to ``<directory>``), put a complete copy in its place, with a warning: the new one
    (its manifest is written before the first rename, so it is complete), or where there
    is none the old one. Whether ``directory`` is now in place. A save that never got to
    its first rename is left alone (a leftover, as a save killed earlier leaves). Safe
    against the saver's own second rename (``save`` takes its temporary directory gone
    and its token in place for a success)."""
    directory = os.fspath(directory)
    parent, base = os.path.split(os.path.abspath(directory))
    try:
        names = os.listdir(parent)
    except OSError:
        return False
    if base in names:
        return True
    olds = _newest_first(parent, [n for n in names if n.startswith(base + ".old-")])
    tokens = {n[len(base) + 5:] for n in olds}
    for n in _newest_first(parent, [n for n in names if n.startswith(base + ".tmp-")]):
        src = os.path.join(parent, n)
        if n[len(base) + 5:] in tokens and _complete(src, n[len(base) + 5:]):
            return _into_place(src, directory, f"checkpoint: {directory} was missing: a save replacing it was "
                                               f"interrupted between its two renames; completed that save "
                                               f"({src}, complete, is now in its place)")
    for n in olds:
        src = os.path.join(parent, n)
        if _complete(src):
            return _into_place(src, directory, f"checkpoint: {directory} was missing: a save replacing it was "
                                               f"interrupted before its new copy was complete; restored the "
                                               f"previous checkpoint {src} in its place")
    return False


def _into_place(src: str, directory: str, message: str) -> bool:
    try:
        os.rename(src, directory)
    except OSError:  # another process did it first, or a read-only file system (the hint says what to do)
        return os.path.isdir(directory)
    try:
        fd = os.open(os.path.dirname(os.path.abspath(directory)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    warnings.warn(message, stacklevel=3)
    return True


def _leftovers_hint(directory: str) -> str:
    """What the leftovers of saves beside a missing ``directory`` are."""
    parent, base = os.path.split(os.path.abspath(directory))
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return f" ({parent} does not exist either)"
    hints = []
    for n in names:
        src = os.path.join(parent, n)
        if n.startswith(base + ".tmp-"):
            hints.append(f"{n} in {parent} is a complete save that could not be moved into place: rename it to "
                         f"{directory}" if _complete(src, n[len(base) + 5:]) else
                         f"{n} in {parent} is an incomplete save (interrupted), not a checkpoint")
        elif n.startswith(base + ".old-") and _complete(src):
            hints.append(f"{n} in {parent} is the checkpoint a save replaced: rename it to {directory} to use it")
    if not hints:
        found = [n for n in names if "." not in n and os.path.isfile(os.path.join(parent, n, "manifest.json"))]
        hints.append(f"the checkpoints in {parent} are {', '.join(found[-5:])}" if found else
                     f"{parent} holds no checkpoint: give the directory of one (it holds a manifest.json)")
    return "; " + "; ".join(hints)
