"""``torch.distributed.checkpoint`` reading fsharded's own checkpoints: a DCP
``StorageReader`` over the manifest and blocks, so FSDP2 / torchtitan code loads an
fsharded checkpoint with ``dcp.load`` into its DTensors (DCP plans which blocks each rank
reads; every block's checksum is verified as it is read).

>>> dcp.load(state_dict, storage_reader=fs.checkpoint.DCPReader("ckpt/step-100"))

Keys are the dotted paths of the manifest (``params.blocks.0.w``, ``opt_state.0.mu.w``);
non-tensor leaves load as their values.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from fsharded.checkpoint._common import _dtype, _Reader
from fsharded.checkpoint._index import _blocks, read_manifest

__all__ = ["DCPReader"]


class DCPReader(StorageReader):
    """A DCP storage reader for the checkpoint at ``directory`` (``fsharded.checkpoint``'s
    format). Pass it to ``dcp.load(state_dict, storage_reader=...)``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        super().__init__()
        self.directory = os.fspath(directory)
        self._blocks: dict[MetadataIndex, dict] = {}
        self._values: dict[str, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.directory = os.fspath(checkpoint_id)
        self._blocks, self._values = {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            return os.path.isfile(os.path.join(os.fspath(checkpoint_id), "manifest.json"))
        except TypeError:
            return False

    def read_metadata(self) -> Metadata:
        manifest = read_manifest(self.directory)
        by_path = _blocks(self.directory, manifest)
        md: dict[str, Any] = {}
        for e in manifest["leaves"]:
            path = e["path"]
            if "shape" not in e:
                md[path] = BytesStorageMetadata()
                self._values[path] = e.get("value")
                continue
            chunks = []
            for b in by_path.get(path, []):
                index = MetadataIndex(path, torch.Size(b["start"]))
                self._blocks[index] = b
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(b["start"]), sizes=torch.Size(b["shape"])))
            md[path] = TensorStorageMetadata(properties=TensorProperties(dtype=_dtype(e["dtype"])),
                                             size=torch.Size(e["shape"]), chunks=chunks)
        return Metadata(state_dict_metadata=md, storage_data=None)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kw: Any) -> None:
        if not self._blocks and not self._values:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        dtypes = {e["path"]: _dtype(e["dtype"]) for e in read_manifest(self.directory)["leaves"] if "dtype" in e}
        reader = _Reader(self.directory)
        try:
            for req in plan.items:
                fqn = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save(self._values.get(fqn), buf)
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                    continue
                block = self._blocks[MetadataIndex(fqn, req.storage_index.offset)]
                t = reader.read(block, dtypes[fqn])  # checksum verified
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    t = t.narrow(d, o, n)
                target = planner.resolve_tensor(req).detach()
                if target.size() != t.size():
                    raise AssertionError(f"{fqn}: DCP asked for {tuple(target.size())}, the block holds {tuple(t.size())}")
                target.copy_(t)
                planner.commit_tensor(req, target)
        finally:
            reader.close()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut
