"""What ``fsharded.checkpoint`` and its readers (DeepSpeed's format, DCP's reader of
ours) share: the error type, the dotted paths of a tree's leaves, whether a mesh runs on
real ranks, and reading the manifest and checksummed blocks."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import optree
import torch

from fsharded.mesh import Mesh
from fsharded.spmd._transfer import backend_for

FORMAT = 1  # the manifest's format version; a newer one is refused


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: corrupt, incomplete, of another model,
    or of a newer format."""


def _flatten(tree: Any) -> tuple[list[str], list, Any]:
    """(dotted paths, leaves, treespec); NamedTuple fields and dataclass fields by name
    (``opt_state.0.mu.w``), so a path reads as the attribute it is."""
    accessors, leaves, tdef = optree.tree_flatten_with_accessor(tree)
    paths = [".".join(str(getattr(e, "field", e.entry)) for e in acc) or "<root>" for acc in accessors]
    return paths, leaves, tdef


def _distributed(mesh: Mesh, backend: str | None) -> bool:
    return backend_for(mesh, backend) == "distributed" and mesh.size > 1


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"checkpoint: unknown dtype {name!r}")
    return dt


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of the checkpoint at ``directory`` (checked for completeness and format)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        parent = os.path.dirname(os.path.abspath(directory)) or "."
        base = os.path.basename(os.path.abspath(directory))
        partial = sorted(n for n in os.listdir(parent) if n.startswith(base + ".tmp-")) \
            if os.path.isdir(parent) else []
        hint = (f"; {', '.join(partial)} in {parent} is an incomplete save (interrupted), not "
                f"a checkpoint") if partial else ""
        raise FileNotFoundError(f"checkpoint: no checkpoint at {directory}{hint}")
    mpath = os.path.join(directory, "manifest.json")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {mpath} is missing: {directory} is not a complete "
                              f"checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint: {mpath} is corrupt ({e})") from None
    version = manifest.get("format")
    if not isinstance(version, int) or version > FORMAT:
        raise CheckpointError(
            f"checkpoint: {directory} has format {version!r}, this fsharded reads format "
            f"{FORMAT} and older; load it with a newer fsharded")
    return manifest


def _blocks(directory: str, writers: int) -> dict[str, list[dict]]:
    by_path: dict[str, list[dict]] = {}
    for w in range(writers):
        p = os.path.join(directory, f"blocks-{w:05d}.json")
        try:
            with open(p) as f:
                for b in json.load(f):
                    by_path.setdefault(b["path"], []).append(b)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint: {p} is missing (writer {w} of {writers})") from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint: {p} is corrupt ({e})") from None
    return by_path


class _Reader:
    """Reads blocks from the data files (kept open), verifying each one's checksum."""

    def __init__(self, directory: str) -> None:
        self.directory, self.files = directory, {}

    def read(self, b: dict, dtype: torch.dtype) -> torch.Tensor:
        path = os.path.join(self.directory, b["file"])
        f = self.files.get(path)
        if f is None:
            try:
                f = self.files[path] = open(path, "rb")
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint: {path} is missing (it holds {b['path']})") from None
        f.seek(b["offset"])
        t = torch.empty(b["nbytes"], dtype=torch.uint8)
        buf = memoryview(t.numpy())
        got = f.readinto(buf) if b["nbytes"] else 0  # straight into the tensor: one copy
        if got != b["nbytes"]:
            raise CheckpointError(f"checkpoint: {path} is truncated: {b['path']}'s block at byte "
                                  f"{b['offset']} has {got} of {b['nbytes']} bytes")
        if zlib.crc32(buf) != b["crc32"]:
            raise CheckpointError(f"checkpoint: checksum mismatch in {path} for {b['path']} (block at "
                                  f"{b['start']}, bytes {b['offset']}-{b['offset'] + b['nbytes']}): "
                                  f"the file is corrupt")
        return t.view(dtype).reshape(b["shape"])

    def close(self) -> None:
        for f in self.files.values():
            f.close()
