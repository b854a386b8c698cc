"""Optimizer offload runs shared by the virtual-mesh tests and the gloo ranks."""

from __future__ import annotations

import tempfile

import optree
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

STEPS = 10
BUCKET = 2048  # elements per streamed bucket: the tiny GPT streams in ~100 buckets


def make_step(mesh_axes: dict, stage: int, tier: str | None, *, nvme_path: str | None = None, donate: bool = False,
              bucket: int = BUCKET, optimizer=None, params_tier: str | None = None):
    params = gpt.init(T.CONFIG, 0)
    kw = {}
    if tier is not None:
        kw = dict(offload_optimizer=tier, bucket_elems=bucket, offload_params=params_tier,
                  nvme_path=(nvme_path or tempfile.mkdtemp(prefix="offload-test-"))
                  if "nvme" in (tier, params_tier) else None)
    plan = fs.parallel.zero(stage, min_size=16, **kw)(P(), params)
    opt = optimizer if optimizer is not None else fs.optim.adamw(T.LR, weight_decay=T.WD)
    step = fs.train_step(gpt.loss, opt, mesh=fs.Mesh(mesh_axes), param_specs=plan, clip=T.CLIP, donate=donate,
                         blocks="blocks")
    return step, params


def run(mesh_axes: dict, stage: int, tier: str | None, *, steps: int = STEPS, donate: bool = False,
        nvme_path: str | None = None, params_tier: str | None = None) -> dict:
    step, params = make_step(mesh_axes, stage, tier, nvme_path=nvme_path, donate=donate, params_tier=params_tier)
    state = step.init(params)
    losses = []
    for b in T.batches(steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    files = fs.parallel.offload.nvme_files(state.opt_state)
    return {"losses": losses, "params": step.params(state), "files": len(files),
            "moments": 2 * len(optree.tree_leaves(state.params)),
            "param_files": len(fs.parallel.offload.nvme_files(state.params))}


def same(a: dict, b: dict) -> bool:
    """Bit for bit: every loss and every final parameter."""
    return a["losses"] == b["losses"] and all(
        torch.equal(x, y) for x, y in zip(optree.tree_leaves(a["params"]), optree.tree_leaves(b["params"])))


def gloo_offload(world: int) -> dict:
    """On each rank: every ZeRO stage in device memory and with each tier, and whether
    they agree bit for bit; the offloaded runs' losses and parameters, to compare with the
    virtual mesh."""
    from fsharded.parallel import _buckets, offload

    out = {}
    finish, sunk = _buckets.InBackward.finish, _buckets.HostSink.finish
    stream = offload.stream_update
    for stage in (1, 2, 3):
        ref = run({"data": world}, stage, None)
        for tier in ("cpu", "nvme"):
            seen = []  # per backward: whether its buckets went to the host, how many before it ended
            sinks = []  # per backward (ZeRO-3): gradients copied to the host before it ended, and in all

            def recorded(self, seen=seen):
                seen.append((self.to_host, self.streamed, len(self.buckets)))
                return finish(self)

            def recorded_sink(self, taken=None, sinks=sinks):
                out = sunk(self, taken)
                mine = [g for g, w in zip(out, self.watched) if w]
                sinks.append((self.streamed, len(mine), all(offload.on_host(g) for g in mine)))
                return out

            updates = []  # per update: its gradients read where backward put them on the host, of all

            def recorded_update(step, params, grads, *a, updates=updates, **k):
                updates.append((sum(offload.on_host(g) for g in grads), len(grads)))
                return stream(step, params, grads, *a, **k)

            _buckets.InBackward.finish, _buckets.HostSink.finish = recorded, recorded_sink
            offload.stream_update = recorded_update
            try:
                got = run({"data": world}, stage, tier)
            finally:
                _buckets.InBackward.finish, _buckets.HostSink.finish = finish, sunk
                offload.stream_update = stream
            out[(stage, tier)] = {"same": same(ref, got), "files": got["files"], "moments": got["moments"],
                                  "losses": got["losses"], "params": got["params"], "backward": seen,
                                  "sinks": sinks, "updates": updates}
    return out


def train_then_die(ckpt: str, nvme_path: str, save_at: int, die_at: int, threads: int = 0) -> None:
    """One process, NVMe tier: train, save a checkpoint after step ``save_at``, then die
    (SIGKILL) in the middle of step ``die_at``'s update, with some of its writes to the
    state files done and others not. ``threads``: the caller's intra-op threads (other
    counts sum in other orders: the numbers compared bit for bit would differ)."""
    import os
    import signal

    from fsharded.kernels import aio

    if threads:
        torch.set_num_threads(threads)

    step, params = make_step({"data": 1}, 2, "nvme", nvme_path=nvme_path)
    state = step.init(params)
    writes = {"armed": False, "n": 0}
    write = aio.File.write

    def dying_write(self, *a, **k):
        if writes["armed"]:
            writes["n"] += 1
            if writes["n"] == 5:
                os.kill(os.getpid(), signal.SIGKILL)
        return write(self, *a, **k)

    aio.File.write = dying_write
    for i, b in enumerate(T.batches(die_at), start=1):
        writes["armed"] = i == die_at
        state, _ = step(state, b)
        if i == save_at:
            step.save(state, ckpt)
    raise AssertionError("the run should have died in its update")


def mapped_rss(paths: list[str]) -> dict[str, int]:
    """Resident bytes of this process's memory maps of ``paths`` (/proc/self/smaps): the
    file's pages read through its map."""
    out = dict.fromkeys(paths, 0)
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and not head[0].endswith(":"):  # a mapping's header: range, perms, offset, dev, inode[, path]
                current = head[5] if len(head) >= 6 and head[5] in out else None
            elif current is not None and line.startswith("Rss:"):
                out[current] += int(head[1]) * 1024
    return out


def watched(step, state, files: list[str], steps: int = STEPS) -> tuple[list, object, int]:
    """``steps`` steps from ``state``: the losses, the state after, and the most bytes of
    ``files`` resident through their memory maps when an update began (backward is over
    then; the update's O_DIRECT writes drop the pages)."""
    from fsharded.parallel import offload

    update, seen = offload.stream_update, [0]

    def measured(*a, **k):
        seen[0] = max(seen[0], sum(mapped_rss(files).values()))
        return update(*a, **k)

    offload.stream_update = measured
    losses = []
    try:
        for b in T.batches(steps):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
    finally:
        offload.stream_update = update
    return losses, state, seen[0]


def gloo_param_offload(world: int) -> dict:
    """On each rank, ZeRO-3 with the parameters in a tier against device memory, bit for
    bit; and how much of the blocks' parameter files came into memory through their maps
    in training (their shards are read through aio just before each gather)."""
    ref = run({"data": world}, 3, None)
    out = {}
    for tier in ("cpu", "nvme"):
        step, params = make_step({"data": world}, 3, tier, params_tier=tier)
        state = step.init(params)
        blocks = fs.parallel.offload.nvme_files(state.params["blocks"])
        losses, state, mapped = watched(step, state, blocks)
        got = {"losses": losses, "params": step.params(state)}
        out[tier] = {"same": same(ref, got), "losses": losses, "params": got["params"],
                     "block_files": len(blocks), "block_rss": mapped,
                     "block_leaves": len(optree.tree_leaves(params["blocks"])),
                     "files": len(fs.parallel.offload.nvme_files(state.params))}
    return out


def gloo_param_offload_stages(world: int, nvme_path: str) -> dict:
    """On each rank, ZeRO 1 and 2 with the master shards in a tier against device memory,
    bit for bit; the parameter files' pages read through their maps by the time the update
    starts (the step reads the shards through aio before its gather); and a corrupted
    file of a leaf outside the blocks (ZeRO-3 gathers it inside the loss) at the next step."""
    from fsharded.parallel import offload

    out = {}
    for stage in (1, 2):
        ref = run({"data": world}, stage, None)
        for tier in ("cpu", "nvme"):
            step, params = make_step({"data": world}, stage, tier, params_tier=tier, nvme_path=nvme_path)
            state = step.init(params)
            files = fs.parallel.offload.nvme_files(state.params)
            losses, state, mapped = watched(step, state, files)
            got = {"losses": losses, "params": step.params(state)}
            out[(stage, tier)] = {"same": same(ref, got), "files": len(files), "mapped": mapped}
    errors = {}
    for stage in (2, 3):
        step, params = make_step({"data": world}, stage, "nvme", params_tier="nvme", nvme_path=nvme_path)
        b = T.batches(1)[0]
        state, _ = step(step.init(params), b)
        victim = offload.nvme_files(optree.tree_leaves(state.params["emb"]))[0]
        with open(victim, "r+b") as raw:  # each rank its own file: both stop before the gather
            raw.seek(16)
            raw.write(b"\x7f\x7f\x7f\x7f")
        try:
            step(state, b)
            errors[stage] = None
        except RuntimeError as e:
            errors[stage] = (victim, str(e))
    out["errors"] = errors
    return out


def gloo_param_offload_bf16(world: int, nvme_path: str) -> dict:
    """On each rank, ZeRO-3 in bf16 with the parameters and optimizer state on NVMe against
    device memory, bit for bit, and the parameter files' pages read through their maps by
    the time the update starts (the shards are read through aio and cast as they travel)."""
    params = gpt.init(T.CONFIG, 0)

    def run(**kw) -> dict:
        plan = fs.parallel.zero(3, min_size=16, **kw)(P(), params)
        step = fs.train_step(gpt.loss, fs.optim.adamw(T.LR, weight_decay=T.WD), mesh=fs.Mesh({"data": world}),
                             param_specs=plan, clip=T.CLIP, precision="bf16", blocks="blocks")
        state = step.init(params)
        files = fs.parallel.offload.nvme_files(state.params)
        losses, state, mapped = watched(step, state, files, 5)
        return {"losses": losses, "params": step.params(state), "files": len(files), "mapped": mapped}

    ref = run()
    got = run(offload_optimizer="nvme", offload_params="nvme", nvme_path=nvme_path, bucket_elems=BUCKET)
    return {"same": same(ref, got), "files": got["files"], "mapped": got["mapped"]}
