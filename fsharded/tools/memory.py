"""Live-bytes memory tracking on any device, CPU included.

``track()`` installs a dispatch mode that follows tensor *storages*: every storage an op
creates is recorded with its size and a category, and a C++-level weak reference tells
when the storage is really freed (not just when one Python tensor object dies: views,
and tensors autograd saved for backward, keep it alive). Births and deaths are recorded
at op granularity, so the peak is exact at op granularity.

Categories: storages created during backward are ``gradients``; those created by a
collective are ``comm buffers``; everything else is ``activations`` (temporaries
included). Trees that exist before tracking starts (parameters, optimizer state) are
registered with ``tracker.register(tree, category)`` and count as live from the start;
``tracker.reclassify(tree, category)`` moves storages created during tracking (a step's new
parameters, say) into another category, retroactively.

>>> with fs.memory.track() as mem:
...     mem.register(state.params, "parameters"); mem.register(state.opt_state, "optimizer state")
...     state, metrics = step(state, batch)
...     mem.reclassify(state.params, "parameters"); mem.reclassify(state.opt_state, "optimizer state")
>>> print(mem)

Per device on the virtual mesh: there one process holds every device's values, and a
tensor's storage holds one copy per device along the axes it is batched over (a
parameter sharded over ``data`` is one global tensor, each device's shard a slice; a
replicated one is one copy that stands for every device's). ``track(mesh=mesh)`` follows
those axes: ``shard_map`` tags its inputs with their specs' axes and its tokens with
their axis, an op's result gets the union of its operands' axes (vmap keeps batch dims),
a collective re-tags its result (a psum or an all-gather is one copy again), and each
storage counts its bytes divided by its number of copies. The peak is then what one
device holds, as on real ranks (on a symmetric program: every device the same).
"""

from fsharded._memory_hooks import CURRENT, current, in_collective, label  # noqa: F401 - CURRENT, in_collective: as before
from fsharded._memory_tracker import CATEGORIES, MemoryTracker, track

__all__ = ["MemoryTracker", "track", "current", "label", "CATEGORIES"]
