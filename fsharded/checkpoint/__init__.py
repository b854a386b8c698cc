"""Checkpoints of spec-addressed pytrees: every device's shards written once, in parallel,
and read back into any mesh and placement.

>>> fs.checkpoint.save("ckpt/step-100", state, specs, mesh)
>>> state = fs.checkpoint.load("ckpt/step-100", like, specs, mesh)   # any mesh, any specs
>>> state = fs.checkpoint.load("ckpt/step-100", None, specs, mesh)   # the tree as saved

The values are what ``shard_map`` takes on the backend the mesh runs on: global tensors on
the virtual mesh (and on one device), this rank's shards on real ranks. ``load`` lays each
leaf out by the ``specs`` it is given, whatever mesh and specs the checkpoint was saved
with: a ZeRO-3 state saved on 4 ranks loads at ZeRO-1 on 2, on the virtual mesh or on one
device, optimizer moments included (each leaf is walked by its path; NamedTuples and
other nodes are not pickled).

A checkpoint is a directory:

- ``manifest.json``: the format version, the mesh it was saved from, and for every leaf
  its dotted path with global shape, dtype and the spec it was saved with (non-tensor
  leaves: their JSON value); the tree's structure (its containers, keys and order, as
  JSON: ``checkpoint._structure``), from which ``tree_like`` and a load without a template
  rebuild the tree as it was saved; the checksum of each blocks file, and its own
  checksum (of its JSON text without it), so that any edit of the index is refused
  naming the file;
- ``blocks-<writer>.json`` and ``data-<writer>.bin``: each writer's blocks (a leaf's box
  of global indices: start and shape, the byte range in its data file, a CRC-32C, or a
  CRC-32 where the ``crc32c`` package is missing), raw
  C-order bytes back to back. A block held by several devices (replicated along an axis)
  is written by one of them only (coordinate 0 along the axes its spec does not name).

Saves go to ``<directory>.tmp-<token>``, every file and the directory fsynced, then renamed
to ``<directory>``: a crash mid-save leaves no ``<directory>``, and a leftover temporary
directory is ignored (``load`` refuses it, naming it). A replace (``overwrite=True``)
renames the old one to ``<directory>.old-<token>`` first; interrupted between the two
renames, the next ``load`` or ``Manager`` listing puts the complete new one in place (the
old one is removed only once a complete checkpoint is at ``<directory>``). Loading checks
the index before reading a byte (the checksums of the manifest and blocks files; that each
leaf's blocks tile it exactly, within their data files), reads only the blocks that
intersect this device's shards and checks each block's checksum: a flipped byte, an edited
index, a truncated file or a missing block is a ``CorruptCheckpointError`` naming the
file and the leaf, never a partly loaded state.
"""

from fsharded.checkpoint._api import (
    FORMAT,
    CheckpointError,
    CorruptCheckpointError,
    DeepSpeedCheckpoint,
    DirectoryInUseError,
    Manager,
    PendingSave,
    Staging,
    dcp_state_dict,
    export_safetensors,
    load,
    load_dcp,
    load_deepspeed,
    read_deepspeed,
    read_manifest,
    save,
    save_async,
    save_dcp,
    tree_like,
)

__all__ = ["save", "save_async", "PendingSave", "Staging", "load", "tree_like", "Manager", "read_deepspeed",
           "load_deepspeed", "DeepSpeedCheckpoint", "save_dcp", "load_dcp", "dcp_state_dict", "export_safetensors",
           "FORMAT", "CheckpointError", "CorruptCheckpointError", "DirectoryInUseError",
           "read_manifest"]  # and DCPReader (imported when asked for)


def __getattr__(name: str):
    if name == "DCPReader":  # torch.distributed.checkpoint's reader: imported when asked for
        from fsharded.checkpoint._dcp_reader import DCPReader

        return DCPReader
    raise AttributeError(f"module 'fsharded.checkpoint' has no attribute {name!r}")
