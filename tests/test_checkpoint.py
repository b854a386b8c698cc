"""fsharded.checkpoint and step.save / step.load: spec-addressed checkpoints that load into
any mesh and placement (optimizer moments carried over), resume bit for bit, and refuse
corrupt, incomplete, foreign or newer checkpoints with an error naming what is wrong."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import checkpoint_cases as C
import optree
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.checkpoint import CheckpointError

# Another layout sums the same numbers in another order (sharded reductions, vmap vs one
# device): fp32 rounding, measured ~1e-7 relative after a few steps.
TOL = 1e-5


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_is_bit_exact(tmp_path, precision):
    """6 steps straight = 3 steps, save, a new step object, load, 3 steps: losses and every
    state leaf (parameters, moments, step, schedule position, dropout key, loss scale and
    its counters) bit for bit."""
    mesh = {"data": 2}
    ref = C.straight(mesh, 3, precision=precision)
    first = C.save_after(mesh, 3, str(tmp_path / "ck"), precision=precision)
    second = C.load_and_train(mesh, 3, str(tmp_path / "ck"), precision=precision)
    assert C.leaves_equal(second["loaded"], first["state"])
    assert first["losses"] + second["losses"] == ref["losses"]
    assert C.leaves_equal(second["final"], ref["final"])


@pytest.mark.parametrize("target", [({"data": 2}, 1), ({"data": 1}, 0), ({"data": 4}, 2), ({"data": 2}, 0)],
                         ids=["zero1-data2", "one-device", "zero2-data4", "zero0-data2"])
def test_reshard_on_load(tmp_path, target):
    """Saved at ZeRO-3 on data=4, loaded into another mesh and stage: the same global state
    (moments carried over), and training goes on as the saved run would have."""
    saved = C.save_after({"data": 4}, 3, str(tmp_path / "ck"))
    mesh, stage = target
    got = C.load_and_train(mesh, stage, str(tmp_path / "ck"))
    assert C.leaves_equal(got["loaded"], saved["state"])
    ref = C.straight({"data": 4}, 3)
    if mesh["data"] != 4:  # other batch shards draw other dropout masks: only the load is equal
        return
    assert all(abs(a - b) <= TOL * max(1.0, abs(b)) for a, b in zip(got["losses"], ref["losses"][3:]))


def test_manifest_and_layout_on_disk(tmp_path):
    step, params = C.make_step({"data": 2}, 3)
    state = step.init(params)
    step.save(state, tmp_path / "ck")
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["blocks-00000.json", "data-00000.bin", "manifest.json"]
    m = fs.checkpoint.read_manifest(tmp_path / "ck")
    assert m["format"] == fs.checkpoint.FORMAT and m["mesh"] == {"data": 2}
    leaf = next(e for e in m["leaves"] if e["path"] == "params.w_in")
    assert leaf["shape"] == [8, 16] and leaf["dtype"] == "torch.float32" and leaf["spec"] == ["data"]
    # Each element stored once: replicated leaves by one device, sharded ones by each.
    blocks = json.loads((tmp_path / "ck" / "blocks-00000.json").read_text())
    nbytes = sum(b["nbytes"] for b in blocks)
    state_bytes = sum(x.numel() * x.element_size() for x in fs._tree.tree_flatten_with_paths(state)[1]
                      if isinstance(x, torch.Tensor))
    assert nbytes == state_bytes == os.path.getsize(tmp_path / "ck" / "data-00000.bin")


def test_any_tree_and_specs(tmp_path):
    """The module on its own: a tree with a NamedTuple, a tuple, ints, sharded over a 2-D
    mesh, loaded replicated on one device and sharded the other way."""
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    tree = {"w": torch.arange(24.0).reshape(4, 6), "t": Pair(torch.arange(8, dtype=torch.int64), 3),
            "h": (torch.ones(2, 2, dtype=torch.bfloat16), "note")}
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    specs = {"w": P("data", "tensor"), "t": Pair(P(("data", "tensor")), None), "h": (P(), None)}
    fs.checkpoint.save(tmp_path / "a", tree, specs, mesh)
    for m2, s2 in [(fs.Mesh({"data": 1}), P()),
                   (fs.Mesh({"tensor": 2, "data": 2}), {"w": P("tensor", "data"), "t": Pair(P("tensor"), None),
                                                         "h": (P(), None)})]:
        like = {"w": torch.empty(4, 6, device="meta"), "t": Pair(torch.empty(8, dtype=torch.int64), 0),
                "h": (torch.empty(2, 2, dtype=torch.bfloat16), "")}
        got = fs.checkpoint.load(tmp_path / "a", like, s2, m2)
        assert torch.equal(got["w"], tree["w"]) and torch.equal(got["t"].a, tree["t"].a)
        assert got["t"].b == 3 and got["h"][1] == "note" and isinstance(got["t"], Pair)
        assert got["h"][0].dtype == torch.bfloat16 and torch.equal(got["h"][0], tree["h"][0])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        fs.checkpoint.save(tmp_path / "a", tree, specs, mesh)
    tree["w"] = tree["w"] * 2
    fs.checkpoint.save(tmp_path / "a", tree, specs, mesh, overwrite=True)
    assert torch.equal(fs.checkpoint.load(tmp_path / "a", tree, specs, mesh)["w"], tree["w"])
    fs.checkpoint._api._wait_removals()  # the replaced checkpoint is unlinked in a thread
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no temporary or old directory left
    os.makedirs(tmp_path / "a.old-0badf00d")  # a killed process's: the next save removes it
    fs.checkpoint.save(tmp_path / "a", tree, specs, mesh, overwrite=True)
    fs.checkpoint._api._wait_removals()
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_select_loads_one_subtree_resharded(tmp_path):
    """``select=``: a subtree (or one leaf) of a saved tree, laid out by its own specs on
    another mesh; a template that does not fit names the checkpoint's full paths."""
    tree = {"params": {"w": torch.arange(24.0).reshape(4, 6), "b": torch.arange(6.0)},
            "opt": {"mu": {"w": torch.ones(4, 6), "b": torch.zeros(6)}}, "step": torch.tensor(7)}
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    specs = {"params": {"w": P("data", "tensor"), "b": P("tensor")}, "opt": {"mu": {"w": P("data"), "b": P()}},
             "step": P()}
    fs.checkpoint.save(tmp_path / "a", tree, specs, mesh)
    got = fs.checkpoint.load(tmp_path / "a", None, None, fs.Mesh({"data": 1}), select="params")
    assert sorted(got) == ["b", "w"] and torch.equal(got["w"], tree["params"]["w"])
    got = fs.checkpoint.load(tmp_path / "a", {"w": torch.empty(4, 6), "b": torch.empty(6)},
                             {"w": P("tensor"), "b": P()}, fs.Mesh({"tensor": 2}), select="params")
    assert torch.equal(got["w"], tree["params"]["w"]) and torch.equal(got["b"], tree["params"]["b"])
    assert int(fs.checkpoint.load(tmp_path / "a", None, None, fs.Mesh({}), select="step")) == 7
    with pytest.raises(CheckpointError, match=r"params\.w: \[4, 5\] torch.float32 here, \[4, 6\]"):
        fs.checkpoint.load(tmp_path / "a", {"w": torch.empty(4, 5), "b": torch.empty(6)}, None, fs.Mesh({}),
                           select="params")
    with pytest.raises(CheckpointError, match=r"missing: params\.c"):
        fs.checkpoint.load(tmp_path / "a", {"w": torch.empty(4, 6), "b": torch.empty(6), "c": torch.empty(1)},
                           None, fs.Mesh({}), select="params")
    with pytest.raises(CheckpointError, match="no leaves under 'nothing'"):
        fs.checkpoint.load(tmp_path / "a", None, None, fs.Mesh({}), select="nothing")


# -- bad input ------------------------------------------------------------------------------------


def test_a_spec_that_does_not_fit_is_an_error_at_save(tmp_path):
    # The blocks of a leaf whose dim does not divide over its axes would not cover it: the
    # save must fail (naming the leaf and the fix) rather than publish what no load can read.
    mesh = fs.Mesh({"data": 2})
    tree = {"a": torch.arange(5.0), "b": torch.ones(4), "n": 3}
    for specs, names in [({"a": P("data"), "b": P(), "n": P()}, ["a: spec", "not divisible by 2"]),
                         ({"a": P(), "b": P("model"), "n": P()}, ["b: spec", "'model' is not in the mesh"]),
                         ({"a": P(), "b": P(), "n": P("data")}, ["n: spec", "cannot be sharded"])]:
        for save in (fs.checkpoint.save, fs.checkpoint.save_async):
            with pytest.raises(ValueError, match="checkpoint.save") as e:
                save(tmp_path / "ck", tree, specs, mesh)
            assert all(n in str(e.value) for n in names), str(e.value)
    assert os.listdir(tmp_path) == []
    fs.checkpoint.save(tmp_path / "ck", tree, {"a": P(), "b": P("data"), "n": P()}, mesh)
    assert torch.equal(fs.checkpoint.load(tmp_path / "ck", tree, P(), mesh)["a"], tree["a"])


@pytest.mark.multiprocess
def test_a_spec_that_does_not_fit_is_an_error_at_save_on_gloo_ranks(tmp_path):
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(C.save_with_bad_specs, 2, str(tmp_path / "ck")):
        assert len(r["errors"]) == 2 and r["listed"] == []
        assert "b: spec" in r["errors"][0] and "'model' is not in the mesh" in r["errors"][0]
        assert "n: spec" in r["errors"][1] and "cannot be sharded" in r["errors"][1]
        assert r["loaded"] == [0.0] * 4 + [1.0] * 4


def _saved(tmp_path):
    step, params = C.make_step({"data": 2}, 3)
    state = step.init(params)
    step.save(state, tmp_path / "ck")
    return step, params, state


def test_flipped_byte_and_truncated_file_are_named(tmp_path):
    step, params, state = _saved(tmp_path)
    data = tmp_path / "ck" / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*data-00000.bin for opt_state"):
        step.load(tmp_path / "ck", state)
    data.write_bytes(bytes(raw[: len(raw) // 3]))
    with pytest.raises(CheckpointError, match=r"data-00000.bin is truncated: \S+'s block"):
        step.load(tmp_path / "ck", state)


def _crc32c_reference(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_block_checksums_crc32c_and_crc32(tmp_path, monkeypatch):
    from fsharded.checkpoint import _common as _ckpt_common

    step, params, state = _saved(tmp_path)
    blocks = json.loads((tmp_path / "ck" / "blocks-00000.json").read_text())
    raw = (tmp_path / "ck" / "data-00000.bin").read_bytes()
    assert all("crc32c" in b for b in blocks)
    small = [b for b in blocks if 0 < b["nbytes"] <= 4096]
    assert small and all(_crc32c_reference(raw[b["offset"]:b["offset"] + b["nbytes"]]) == b["crc32c"]
                         for b in small)
    assert C.leaves_equal(C.global_state(step, step.load(tmp_path / "ck", params)), C.global_state(step, state))
    # Without the crc32c package: written with zlib's CRC-32, which every reader verifies...
    monkeypatch.setattr(_ckpt_common, "_crc32c", None)
    with pytest.raises(CheckpointError, match=r"checksummed with CRC-32C: pip install crc32c"):
        step.load(tmp_path / "ck", params)
    step.save(state, tmp_path / "old", overwrite=True)
    blocks = json.loads((tmp_path / "old" / "blocks-00000.json").read_text())
    assert all("crc32" in b and "crc32c" not in b for b in blocks)
    monkeypatch.undo()
    assert C.leaves_equal(C.global_state(step, step.load(tmp_path / "old", params)), C.global_state(step, state))
    data = tmp_path / "old" / "data-00000.bin"
    flipped = bytearray(data.read_bytes())
    flipped[-5] ^= 0x01
    data.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*data-00000.bin"):
        step.load(tmp_path / "old", params)


def test_missing_files_and_newer_format(tmp_path):
    step, params, state = _saved(tmp_path)
    m = tmp_path / "ck" / "manifest.json"
    js = json.loads(m.read_text())
    js["format"] = fs.checkpoint.FORMAT + 1
    m.write_text(json.dumps(js))
    with pytest.raises(CheckpointError, match="format 2, this fsharded reads format 1"):
        step.load(tmp_path / "ck", state)
    js["format"] = fs.checkpoint.FORMAT
    m.write_text(json.dumps(js))
    bpath = tmp_path / "ck" / "blocks-00000.json"
    blocks = json.loads(bpath.read_text())
    bpath.write_text(json.dumps([b for b in blocks if not (b["path"] == "params.w_in" and b["start"][0])]))
    with pytest.raises(CheckpointError, match=r"blocks-00000.json does not match the checksum .*manifest.json "
                                              r"records for it"):
        step.load(tmp_path / "ck", state)
    os.remove(tmp_path / "ck" / "blocks-00000.json")
    with pytest.raises(CheckpointError, match="blocks-00000.json is missing"):
        step.load(tmp_path / "ck", state)
    os.remove(m)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        step.load(tmp_path / "ck", state)


def test_another_model_lists_missing_extra_and_misshaped(tmp_path):
    step, params, state = _saved(tmp_path)
    other = dict(params, w_in=torch.zeros(8, 32), extra=torch.zeros(3))
    del other["w_out"]
    with pytest.raises(CheckpointError) as e:
        fs.checkpoint.load(tmp_path / "ck", {"params": other}, P(), step.mesh)
    msg = str(e.value)
    assert "missing: params.extra" in msg and "extra: params.w_out" in msg
    assert "shape/dtype: params.w_in: [8, 32] torch.float32 here, [8, 16] torch.float32" in msg
    assert "extra: opt_state" in msg


def test_interrupted_save_is_ignored_and_named(tmp_path):
    """A save that never finished leaves only its temporary directory: the previous
    checkpoint loads, the unfinished one is refused naming the leftover."""
    step, params, state = _saved(tmp_path)
    os.makedirs(tmp_path / "ck2.tmp-0badc0de")
    (tmp_path / "ck2.tmp-0badc0de" / "data-00000.bin").write_bytes(b"\0" * 10)
    assert C.leaves_equal(C.global_state(step, step.load(tmp_path / "ck", state)), C.global_state(step, state))
    with pytest.raises(FileNotFoundError, match=r"ck2.tmp-0badc0de .* is an incomplete save"):
        step.load(tmp_path / "ck2", state)


_KILLER = textwrap.dedent("""
    import sys, torch, fsharded as fs
    from fsharded import P
    root = sys.argv[1]
    tree = {f"w{i}": torch.full((256, 256), float(i)) for i in range(24)}
    mesh = fs.Mesh({"data": 2})
    for k in range(1000):
        fs.checkpoint.save(f"{root}/step-{k:04d}", tree, P("data"), mesh)
        print(k, flush=True)
""")


@pytest.mark.multiprocess
def test_kill_9_during_saves_leaves_every_finished_checkpoint_loadable(tmp_path):
    """A process saving checkpoints in a loop is killed (SIGKILL) at random moments: every
    step-* directory loads exactly, whatever was in flight is only a temporary directory."""
    import random
    import time

    rng = random.Random(0)
    like = {f"w{i}": torch.empty(256, 256) for i in range(24)}
    for trial in range(8):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        p = subprocess.Popen([sys.executable, "-c", _KILLER, str(root)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "0"  # the first save finished
        time.sleep(rng.uniform(0.0, 0.3))
        p.kill()
        p.wait()
        finished = sorted(n for n in os.listdir(root) if ".tmp-" not in n)
        assert finished, os.listdir(root)
        for name in finished:
            got = fs.checkpoint.load(root / name, like, P("data"), fs.Mesh({"data": 2}))
            assert all(torch.equal(got[f"w{i}"], torch.full((256, 256), float(i))) for i in range(24))


# -- real ranks -------------------------------------------------------------------------------


# Imports once, then per trial forks 2 gloo ranks that save in a loop (each rank its own
# shards, rank 0 the manifest and the rename); prints the ranks' pids once the first save
# is complete and waits for both to end (the test kills them).
_RANKS_KILLER = textwrap.dedent("""
    import os, socket, sys, time
    import torch, torch.distributed as dist
    import fsharded as fs
    from fsharded import P

    def rank_main(rank, port, root, ready_w):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE="2", LOCAL_RANK=str(rank), FSHARDED_SHM="0")
        dist.init_process_group("gloo", rank=rank, world_size=2)
        mesh = fs.Mesh({"data": 2})
        tree = {f"w{i}": torch.full((128, 256), float(i)) for i in range(24)}  # this rank's rows
        for k in range(100000):
            fs.checkpoint.save(f"{root}/step-{k:05d}", tree, P("data"), mesh)
            if k == 0 and rank == 0:
                os.write(ready_w, b"x")
        os._exit(0)

    for line in sys.stdin:
        root = line.strip()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        r, w = os.pipe()
        pids = []
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                try:
                    rank_main(rank, port, root, w)
                finally:
                    os._exit(1)
            pids.append(pid)
        os.read(r, 1)
        os.close(r), os.close(w)
        print(*pids, flush=True)
        for pid in pids:
            os.waitpid(pid, 0)
        print("done", flush=True)
""")


@pytest.mark.multiprocess
def test_kill_9_of_a_rank_during_saves_on_two_gloo_ranks(tmp_path):
    """20 trials: 2 gloo ranks save in a loop; one of them (either) is killed (SIGKILL) at
    a random moment, then the other. Every step-* directory loads exactly; what was in
    flight is a temporary directory that Manager.latest() names and ignores."""
    import random
    import signal
    import time

    rng = random.Random(1)
    like = {f"w{i}": torch.empty(256, 256) for i in range(24)}
    z = subprocess.Popen([sys.executable, "-c", _RANKS_KILLER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        left_over = 0
        for trial in range(20):
            root = tmp_path / f"t{trial}"
            root.mkdir()
            z.stdin.write(f"{root}\n")
            z.stdin.flush()
            pids = [int(x) for x in z.stdout.readline().split()]
            assert len(pids) == 2, pids
            time.sleep(rng.uniform(0.0, 0.4))
            first = rng.randrange(2)
            os.kill(pids[first], signal.SIGKILL)
            time.sleep(rng.uniform(0.0, 0.05))  # the other may go on a little, or block
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[1 - first], signal.SIGKILL)
            assert z.stdout.readline().strip() == "done"
            finished = sorted(n for n in os.listdir(root) if ".tmp-" not in n and ".old-" not in n)
            assert finished, os.listdir(root)
            for name in finished:
                got = fs.checkpoint.load(root / name, like, P("data"), fs.Mesh({"data": 2}))
                assert all(torch.equal(got[f"w{i}"], torch.full((256, 256), float(i))) for i in range(24)), name
            mgr = fs.checkpoint.Manager(root)
            if mgr.incomplete():
                left_over += 1
                with pytest.warns(UserWarning, match="ignoring 1 unfinished save"):
                    assert mgr.latest() == str(root / finished[-1])
            else:
                assert mgr.latest() == str(root / finished[-1])
        assert left_over >= 10  # most kills landed inside a save
    finally:
        z.stdin.close()
        z.kill()
        z.wait()


@pytest.mark.multiprocess
def test_gloo_ranks_and_virtual_mesh_read_each_other(tmp_path):
    from fsharded.testing import run_on_ranks

    # 2 ranks at ZeRO-3 -> the virtual mesh at ZeRO-1, and back onto 2 ranks at ZeRO-2.
    saved = run_on_ranks(C.save_after, 2, {"data": 2}, 3, str(tmp_path / "a"))[0]
    virt = C.load_and_train({"data": 2}, 1, str(tmp_path / "a"))
    assert C.leaves_equal(virt["loaded"], saved["state"])
    C.save_after({"data": 2}, 1, str(tmp_path / "b"))
    ranks = run_on_ranks(C.load_and_train, 2, {"data": 2}, 2, str(tmp_path / "a"))
    for r in ranks:
        assert C.leaves_equal(r["loaded"], saved["state"])
        assert all(abs(a - b) <= TOL * max(1.0, abs(b)) for a, b in zip(r["losses"], virt["losses"]))
    ref = C.straight({"data": 2}, 3)
    assert all(abs(a - b) <= TOL * max(1.0, abs(b)) for a, b in zip(virt["losses"], ref["losses"][3:]))


@pytest.mark.multiprocess
def test_four_ranks_zero3_load_on_two_ranks_zero1(tmp_path):
    from fsharded.testing import run_on_ranks

    saved = run_on_ranks(C.save_after, 4, {"data": 4}, 3, str(tmp_path / "ck"))
    assert len(os.listdir(tmp_path / "ck")) == 1 + 2 * 4  # the manifest, each rank's files
    for r in run_on_ranks(C.load_and_train, 2, {"data": 2}, 1, str(tmp_path / "ck")):
        assert C.leaves_equal(r["loaded"], saved[0]["state"])


def test_manager_keeps_the_newest_and_finds_the_latest(tmp_path):
    step, params = C.make_step({"data": 2}, 0)
    mgr = fs.checkpoint.Manager(tmp_path / "run", keep=2, every=2)
    state = step.init(params)
    assert mgr.latest() is None and not mgr.due(0) and not mgr.due(1) and mgr.due(4)
    for b in C.batches(0, 6):
        state, _ = step(state, b)
        if mgr.due(int(state.step)):
            mgr.save_state(step, state)
    assert mgr.steps() == [4, 6]
    fs.checkpoint._api._wait_removals()  # pruned ones are renamed away at once, unlinked in a thread
    assert sorted(os.listdir(tmp_path / "run")) == [".fsharded-lock", "step-00000004", "step-00000006"]  # the run's lock
    os.makedirs(tmp_path / "run" / "step-00000008.tmp-deadbeef")
    with pytest.warns(UserWarning, match=r"unfinished save\(s\): .*step-00000008.tmp-deadbeef"):
        latest = mgr.latest()
    assert latest == mgr.path(6)
    assert C.leaves_equal(C.global_state(step, step.load(latest, params)), C.global_state(step, state))
    with pytest.raises(ValueError, match="keep must be a positive int"):
        fs.checkpoint.Manager(tmp_path, keep=0)


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    from fsharded.checkpoint import _write as ck

    step, params, state = _saved(tmp_path)
    before = C.global_state(step, state)
    state2, _ = C.train(step, state, 0, 1)
    real, calls = ck._bytes, []

    def full(t):  # the disk fills up after a few blocks
        calls.append(1)
        if len(calls) > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(t)

    monkeypatch.setattr(ck, "_bytes", full)
    with pytest.raises(OSError, match="No space left"):
        step.save(state2, tmp_path / "ck", overwrite=True)
    monkeypatch.setattr(ck, "_bytes", real)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary directory left
    assert C.leaves_equal(C.global_state(step, step.load(tmp_path / "ck", params)), before)


@pytest.mark.parametrize("chunk", [None, 4096 * 3])
def test_direct_and_buffered_writes_give_the_same_files(tmp_path, monkeypatch, chunk):
    # O_DIRECT (where the file system takes it) writes through an aligned chunk buffer
    # and cuts the last chunk's padding; the buffered path writes as is; a background save
    # writes the file from its staging arena (padded to the alignment, then cut): the same
    # bytes every way. Small chunks put block boundaries inside chunks and chunks inside
    # blocks; the strided leaf and the odd-sized ones put blocks at unaligned offsets.
    from fsharded.checkpoint import _write as ck

    if chunk is not None:
        monkeypatch.setattr(ck, "CHUNK", chunk)
    tree = {"a": torch.randn(1001), "b": torch.arange(7, dtype=torch.int16), "c": torch.randn(3, 4099),
            "d": torch.randn(6, 9).t(), "e": torch.tensor(2.5, dtype=torch.bfloat16)}
    directs = []
    staging = fs.checkpoint.Staging()
    runs = [(mode, how) for mode in ("1", "0") for how in ("save", "async", "async-again")]
    for mode, how in runs:
        monkeypatch.setenv("FSHARDED_CKPT_DIRECT", mode)
        real = ck._DataFile.__init__

        def spy(self, path, real=real):
            real(self, path)
            directs.append(self.direct)

        monkeypatch.setattr(ck._DataFile, "__init__", spy)
        if how == "save":
            fs.checkpoint.save(tmp_path / f"{mode}-{how}", tree, P(), fs.Mesh({"data": 1}))
        else:  # the second one reuses the staging arena of the first
            fs.checkpoint.save_async(tmp_path / f"{mode}-{how}", tree, P(), fs.Mesh({"data": 1}),
                                     staging=staging).wait()
        monkeypatch.setattr(ck._DataFile, "__init__", real)
        got = fs.checkpoint.load(tmp_path / f"{mode}-{how}", tree, P(), fs.Mesh({"data": 1}))
        assert all(torch.equal(got[k], tree[k]) for k in tree)
    assert directs[3:] == [False] * 3
    data = [(tmp_path / f"{m}-{h}" / "data-00000.bin").read_bytes() for m, h in runs]
    assert all(d == data[0] for d in data)
    assert len(data[0]) == sum(t.numel() * t.element_size() for t in tree.values())
    assert staging.nbytes == -(-len(data[0]) // 4096) * 4096  # one arena kept, reused
    staging.release()
    assert staging.nbytes == 0


def test_saves_of_trees_of_one_structure_take_each_its_own_layout(tmp_path):
    # A save's layout (manifest entries, blocks, offsets) and the staging arena's views of
    # its blocks are kept for the next save of the same kind of tree. Trees with the same
    # structure but other shapes, dtypes, specs or JSON values must each get their own:
    # every one round-trips exactly, through save and through save_async on one arena.
    mesh = fs.Mesh({"data": 2})
    g = torch.Generator().manual_seed(0)
    cases = [
        ({"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g), "n": 3}, {"w": P("data"), "b": P(), "n": P()}),
        ({"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g), "n": 4}, {"w": P("data"), "b": P(), "n": P()}),
        ({"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g), "n": 5}, {"w": P(None, "data"), "b": P(), "n": P()}),
        ({"w": torch.randn(8, 2, generator=g), "b": torch.randn(6, generator=g), "n": 6}, {"w": P("data"), "b": P(), "n": P()}),
        ({"w": torch.randn(4, 6, generator=g).double(), "b": torch.randn(6, generator=g), "n": 7}, {"w": P("data"), "b": P(), "n": P()}),
        ({"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g), "n": "x"}, {"w": P("data"), "b": P(), "n": P()}),
    ]
    staging = fs.checkpoint.Staging()
    layouts = []
    for i, (tree, specs) in enumerate(cases):
        for how in ("save", "async"):
            d = tmp_path / f"{i}-{how}"
            if how == "save":
                fs.checkpoint.save(d, tree, specs, mesh)
            else:
                pending = fs.checkpoint.save_async(d, tree, specs, mesh, staging=staging)
                layouts.append(pending._job.layout)
                pending.wait()
            got = fs.checkpoint.load(d, tree, specs, mesh)
            assert got["n"] == tree["n"]
            for k in ("w", "b"):
                assert got[k].dtype == tree[k].dtype and torch.equal(got[k], tree[k]), (i, how, k)
            manifest = fs.checkpoint.read_manifest(d)
            assert [e["spec"] for e in manifest["leaves"] if e["path"] == "w"] == [
                [list(a) if isinstance(a, tuple) else a for a in specs["w"]]]
    assert layouts[0] is layouts[1] and layouts[1] is not layouts[2]  # only a new value: one layout
    assert len({id(x) for x in layouts[1:]}) == len(layouts) - 1


# -- DCP ------------------------------------------------------------------------------------------


def test_dcp_on_one_process(tmp_path):
    """save_dcp / load_dcp without a process group: a ZeRO-3 state from the virtual mesh into
    a one-device step, leaf by leaf (no NamedTuple pickled whole)."""
    import torch.distributed.checkpoint as dcp

    step, params = C.make_step({"data": 2}, 3)
    state, _ = C.train(step, step.init(params), 0, 2)
    fs.checkpoint.save_dcp(tmp_path / "d", state, step.state_specs(state), step.mesh)
    keys = set(dcp.FileSystemReader(str(tmp_path / "d")).read_metadata().state_dict_metadata)
    assert "opt_state.0.mu.w_in" in keys or any(k.endswith("mu.w_in") for k in keys)
    one, _ = C.make_step({"data": 1}, 0)
    like = one.init(params)
    got = fs.checkpoint.load_dcp(tmp_path / "d", like, one.state_specs(like), one.mesh)
    assert C.leaves_equal(C.global_state(one, got), C.global_state(step, state))
    with pytest.raises(CheckpointError, match=r"missing: params.extra"):
        fs.checkpoint.load_dcp(tmp_path / "d", {"params": dict(params, extra=torch.zeros(2))}, P(), one.mesh)
    # Our own format, read by dcp.load through fs.checkpoint.DCPReader (checksums verified).
    step.save(state, tmp_path / "native")
    template = fs.checkpoint.dcp_state_dict(like, one.state_specs(like), one.mesh)
    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in template.items()}
    dcp.load(template, storage_reader=fs.checkpoint.DCPReader(tmp_path / "native"), no_dist=True)
    assert C.leaves_equal({k: v for k, v in template.items() if isinstance(v, torch.Tensor)},
                          C.global_state(step, state))
    data = tmp_path / "native" / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="checksum mismatch"):  # DCP wraps our error
        dcp.load(template, storage_reader=fs.checkpoint.DCPReader(tmp_path / "native"), no_dist=True)


@pytest.mark.multiprocess
def test_dcp_both_ways_on_gloo_ranks(tmp_path):
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(C.dcp_cases, 2, str(tmp_path)):
        assert C.leaves_equal(r["ours_zero1"], r["saved"])
        tensors = {k: v for k, v in r["saved"].items() if k in r["plain_dcp"]}
        assert tensors and C.leaves_equal(r["plain_dcp"], tensors)
        assert C.leaves_equal(r["dcp_reads_ours"], tensors)  # dcp.load of our own format
        # FSDP2's checkpoint, keys = the module's names = the fs.nn params paths.
        paths, leaves, _ = fs.checkpoint._common._flatten(r["fsdp2"])
        assert C.leaves_equal(dict(zip(paths, leaves)), r["fsdp2_ref"])


# -- export ---------------------------------------------------------------------------------------


def test_export_safetensors_streams_the_full_params(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    step, params = C.make_step({"data": 2}, 3)
    state, _ = C.train(step, step.init(params), 0, 2)
    step.save(state, tmp_path / "ck")
    names = fs.checkpoint.export_safetensors(tmp_path / "ck", tmp_path / "p.safetensors")
    got = safetensors.load_file(str(tmp_path / "p.safetensors"))
    full = step.params(state)
    paths, leaves, _ = fs.checkpoint._common._flatten(full)
    assert sorted(names) == sorted(paths) and all(torch.equal(got[p], x) for p, x in zip(paths, leaves))
    fs.checkpoint.export_safetensors(tmp_path / "ck", tmp_path / "b.safetensors", dtype=torch.bfloat16,
                                     rename={"w_in": "embed.weight"})
    half = safetensors.load_file(str(tmp_path / "b.safetensors"))
    assert half["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(half["embed.weight"], full["w_in"].to(torch.bfloat16))


def test_fsharded_export_into_a_hugging_face_model(tmp_path):
    """An HF GPT-2 trained through fs.nn at ZeRO-3, saved, exported by the CLI: the file
    loads into a fresh GPT2LMHeadModel (tied lm_head restored by HF) with the trained
    model's outputs."""
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    fm = fs.nn.functional(transformers.GPT2LMHeadModel(cfg))
    tok = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))

    def loss(p, b):
        return torch.nn.functional.cross_entropy(fm.apply(p, input_ids=b[:, :-1]).logits.flatten(0, 1),
                                                 b[:, 1:].flatten())

    mesh = fs.Mesh({"data": 2})
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh,
                         param_specs=fs.parallel.zero(3, min_size=8)(P(), fm.params), blocks=fm.blocks)
    state = step.init(fm.params)
    for _ in range(2):
        state, _ = step(state, tok)
    step.save(state, tmp_path / "ck")
    r = subprocess.run([sys.executable, "-m", "fsharded", "export", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "tensors ->" in r.stdout, r.stderr
    fresh = transformers.GPT2LMHeadModel(cfg)
    missing, unexpected = fresh.load_state_dict(safetensors.load_file(str(tmp_path / "m.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    fresh.tie_weights()
    with torch.no_grad():
        want = fm.apply(step.params(state), input_ids=tok[:, :-1]).logits
        assert torch.equal(fresh(input_ids=tok[:, :-1]).logits, want)
    bad = subprocess.run([sys.executable, "-m", "fsharded", "export", str(tmp_path / "nope"), str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no checkpoint at" in bad.stderr


# -- saving in the background ---------------------------------------------------------------------


def _state_bytes(state) -> tuple[int, int]:
    sizes = [x.numel() * x.element_size() for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]
    return sum(sizes), max(sizes)


def test_async_save_snapshots_the_state_and_bounds_its_copies(tmp_path):
    step, params = C.make_step({"data": 2}, 3)
    state, _ = C.train(step, step.init(params), 0, 3)
    before = C.global_state(step, state)
    total, largest = _state_bytes(state)
    for bound in (None, total // 4, 1):
        d = tmp_path / f"ck-{bound}"
        floats = [t for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        kept = [t.clone() for t in floats]
        pending = step.save_async(state, d, max_staged_bytes=bound)
        # The call has returned: the state may change (a donated step would overwrite it).
        for t in floats:
            t.fill_(123.0)
        assert pending.wait() == str(d) and pending.done()
        for t, k in zip(floats, kept):
            t.copy_(k)
        assert C.leaves_equal(C.global_state(step, step.load(d, params)), before)
        if bound is None:
            assert pending.peak_staged_bytes <= total
        else:  # the bound, or one block when a block is larger
            assert pending.peak_staged_bytes <= max(bound, largest), (bound, pending.peak_staged_bytes)
    with open(d / "blocks-00000.json") as f:
        block = max(b["nbytes"] for b in json.load(f))
    assert pending.peak_staged_bytes == block  # bound=1: one block at a time
    with pytest.raises(ValueError, match="max_staged_bytes"):
        step.save_async(state, tmp_path / "x", max_staged_bytes=0)


def test_async_save_failure_is_raised_at_wait_and_keeps_the_previous(tmp_path, monkeypatch):
    import errno

    from fsharded.checkpoint import _write as ck

    step, params, state = _saved(tmp_path)
    before = C.global_state(step, state)
    state2, _ = C.train(step, state, 0, 1)
    real, calls = ck._bytes, []

    def full(t):
        calls.append(1)
        if len(calls) > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(t)

    monkeypatch.setattr(ck, "_bytes", full)
    pending = step.save_async(state2, tmp_path / "ck", overwrite=True, max_staged_bytes=64)
    with pytest.raises(OSError, match="No space left"):
        pending.wait()
    monkeypatch.setattr(ck, "_bytes", real)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the temporary directory removed
    assert C.leaves_equal(C.global_state(step, step.load(tmp_path / "ck", params)), before)


def test_async_save_failing_while_writing_from_its_arena_keeps_the_previous(tmp_path, monkeypatch):
    # The unbounded path copies every block into the step's staging arena and writes the
    # file from it: a write that fails there is raised at wait(), nothing is published,
    # and the arena goes back to the step for the next save, which succeeds.
    import errno

    from fsharded.checkpoint import _write as ck

    step, params, state = _saved(tmp_path)
    before = C.global_state(step, state)
    state2, _ = C.train(step, state, 0, 1)

    def full(self, view, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck._DataFile, "write_from", full)
    pending = step.save_async(state2, tmp_path / "ck", overwrite=True)
    with pytest.raises(OSError, match="No space left"):
        pending.wait()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the temporary directory removed
    assert C.leaves_equal(C.global_state(step, step.load(tmp_path / "ck", params)), before)
    held = step.staging.nbytes
    assert held >= _state_bytes(state2)[0]
    monkeypatch.undo()
    after = C.global_state(step, state2)
    assert step.save_async(state2, tmp_path / "ck", overwrite=True).wait() == str(tmp_path / "ck")
    assert step.staging.nbytes == held  # the same arena, reused
    assert C.leaves_equal(C.global_state(step, step.load(tmp_path / "ck", params)), after)


def test_manager_saves_in_the_background(tmp_path):
    step, params = C.make_step({"data": 2}, 2)
    mgr = fs.checkpoint.Manager(tmp_path, keep=2)
    state = step.init(params)
    for i in range(4):
        state, _ = C.train(step, state, i, 1)
        pending = mgr.save_state(step, state, blocking=False)
        assert isinstance(pending, fs.checkpoint.PendingSave)
    snapshot = C.global_state(step, state)
    assert mgr.wait() == mgr.path(4)
    assert mgr.steps() == [3, 4]
    assert C.leaves_equal(C.global_state(step, step.load(mgr.latest(), params)), snapshot)


@pytest.mark.multiprocess
def test_async_save_on_gloo_ranks_while_training(tmp_path):
    from fsharded.testing import run_on_ranks

    for bound in (4096, None):  # copies a few blocks at a time; all at once into the arena
        d = str(tmp_path / f"ck-{bound}")
        res = run_on_ranks(C.async_save_while_training, 2, {"data": 2}, 3, d, bound)
        for r in res:
            assert C.leaves_equal(r["loaded"], r["snapshot"])
            assert r["trained_on"]  # the steps after the call changed the state
        virt = C.load_and_train({"data": 2}, 1, d)
        assert C.leaves_equal(virt["loaded"], res[0]["snapshot"])


def test_load_without_a_template_rebuilds_the_tree_from_the_manifest(tmp_path):
    step, params = C.make_step({"data": 2}, 3)
    state, _ = C.train(step, step.init(params), 0, 2)
    step.save(state, tmp_path / "ck")
    for target in (({"data": 2}, 1), ({"data": 1}, 0)):
        other, _ = C.make_step(*target)
        got = other.load(tmp_path / "ck")  # no params given
        assert optree.tree_structure(got.params) == optree.tree_structure(params)
        assert C.leaves_equal(C.global_state(other, got), C.global_state(step, state))
        got, _ = C.train(other, got, 2, 1)  # and it trains on
    tree = fs.checkpoint.tree_like(tmp_path / "ck", "params")
    assert all(x.device.type == "meta" for x in optree.tree_leaves(tree))
    with pytest.raises(CheckpointError, match="no leaves under 'nope'"):
        fs.checkpoint.tree_like(tmp_path / "ck", "nope")


def test_waiting_ranks_read_a_renamed_temporary_directory_as_not_failed(tmp_path):
    # A rank polling for rank 0's rename may look at the temporary directory just as it is
    # renamed into place: that is not a failure (it raised FileNotFoundError once).
    from fsharded.checkpoint import _api as ck

    assert ck._failed_markers(str(tmp_path / "gone.tmp-0000")) == []
    (tmp_path / "ck.tmp-1").mkdir()
    (tmp_path / "ck.tmp-1" / "failed-00001").write_text("OSError: disk full")
    assert ck._failed_markers(str(tmp_path / "ck.tmp-1")) == ["failed-00001"]


def test_async_save_cut_short_while_staging_publishes_nothing(tmp_path):
    """A copy that fails in the caller (here a leaf whose detach raises) is raised there,
    and the writer, seeing the queue end early, publishes no checkpoint."""
    import time

    class Boom(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.detach:
                raise RuntimeError("boom")
            return super().__torch_function__(func, types, args, kwargs or {})

    tree = {"a": torch.ones(64), "b": torch.ones(64).as_subclass(Boom)}
    with pytest.raises(RuntimeError, match="boom"):
        fs.checkpoint.save_async(tmp_path / "ck", tree, P(), fs.Mesh({"data": 1}))
    deadline = time.monotonic() + 10
    while os.listdir(tmp_path) and time.monotonic() < deadline:  # the thread cleans up
        time.sleep(0.01)
    assert os.listdir(tmp_path) == []
