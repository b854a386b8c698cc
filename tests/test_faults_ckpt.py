"""Checkpoints under faults: edited index files (every single-digit edit refused, or, in a
checkpoint without index checksums, loading the exact values or refused), two runs on one
save directory (the second refused naming the first; a dead holder's lock taken over), an
overwrite interrupted between its two renames (completed, never deleted), resuming past a
damaged newest checkpoint (with a warning naming it), and load errors that say where and
what (a checkpoint of another model summarised in one line first)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import checkpoint_cases as C
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.checkpoint import CheckpointError

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
DAMAGED = "the checkpoint is damaged"  # the start of what every damaged-checkpoint error says to do


# -- single-digit edits of the index files ---------------------------------------------------------


def _small(root) -> tuple[dict, dict, fs.Mesh]:
    """A small checkpoint on the virtual mesh: a leaf split in two blocks, a replicated
    int leaf, a 0-d leaf and a JSON value."""
    tree = {"a": torch.arange(24, dtype=torch.float32).reshape(4, 6) * 1.5,
            "b": torch.arange(6, dtype=torch.int32) - 3,
            "c": torch.tensor(2.5, dtype=torch.float64), "n": 7}
    specs = {"a": P("data"), "b": P(), "c": P(), "n": None}
    mesh = fs.Mesh({"data": 2})
    fs.checkpoint.save(root, tree, specs, mesh)
    return tree, specs, mesh


def _digit_edits(raw: bytes):
    """Every digit of ``raw`` replaced by three others, one edit at a time."""
    for i, ch in enumerate(raw):
        if 48 <= ch <= 57:
            for k in (1, 5, 9):
                yield i, raw[:i] + bytes([48 + (ch - 48 + k) % 10]) + raw[i + 1:]


def _load_or_error(root, tree, specs, mesh):
    like = {"a": torch.empty(4, 6), "b": torch.empty(6, dtype=torch.int32),
            "c": torch.empty((), dtype=torch.float64), "n": 0}
    try:
        return fs.checkpoint.load(root, like, specs, mesh), None
    except CheckpointError as e:
        return None, str(e)


def _identical(got: dict, tree: dict) -> bool:
    return got["n"] == tree["n"] and all(
        got[k].dtype == tree[k].dtype and got[k].shape == tree[k].shape and torch.equal(got[k], tree[k])
        for k in "abc")


def test_every_single_digit_edit_of_a_blocks_file_is_refused_naming_it(tmp_path):
    """The manifest records each blocks file's checksum: any edit of one is refused."""
    root = tmp_path / "ck"
    tree, specs, mesh = _small(root)
    bpath = root / "blocks-00000.json"
    raw = bpath.read_bytes()
    n = 0
    for i, edited in _digit_edits(raw):
        bpath.write_bytes(edited)
        got, err = _load_or_error(root, tree, specs, mesh)
        assert err is not None, f"edit at byte {i} ({edited[max(0, i - 20):i + 20]!r}) loaded"
        assert str(bpath) in err and DAMAGED in err, err
        n += 1
    assert n > 200
    bpath.write_bytes(raw)
    assert _identical(_load_or_error(root, tree, specs, mesh)[0], tree)


def test_every_single_digit_edit_of_a_manifest_is_refused_naming_it(tmp_path):
    root = tmp_path / "ck"
    tree, specs, mesh = _small(root)
    mpath = root / "manifest.json"
    raw = mpath.read_bytes()
    for i, edited in _digit_edits(raw):
        mpath.write_bytes(edited)
        got, err = _load_or_error(root, tree, specs, mesh)
        assert err is not None, f"edit at byte {i} ({edited[max(0, i - 20):i + 20]!r}) loaded"
        assert str(mpath) in err or "this fsharded reads format" in err, err


def _unsealed(root) -> None:
    """The checkpoint as one written before the index files were checksummed."""
    mpath = root / "manifest.json"
    m = json.loads(mpath.read_text())
    m.pop("checksum", None)
    m.pop("index", None)
    mpath.write_text(json.dumps(m))


def test_single_digit_edits_of_an_unchecksummed_index_load_exact_values_or_are_refused(tmp_path):
    """Without index checksums (an older checkpoint) the blocks must tile every leaf
    exactly, in bounds, with bytes that fit their box and their data file: every
    single-digit edit of the blocks file loads bit-identical values or is refused naming
    the directory, the file and what to do (before: of these 276 edits 2 loaded other
    values, shifted rows or uninitialised memory, and 15 raised a bare RuntimeError)."""
    root = tmp_path / "ck"
    tree, specs, mesh = _small(root)
    _unsealed(root)
    bpath = root / "blocks-00000.json"
    raw = bpath.read_bytes()
    refused = 0
    for i, edited in _digit_edits(raw):
        bpath.write_bytes(edited)
        got, err = _load_or_error(root, tree, specs, mesh)
        where = f"edit at byte {i}: {edited[max(0, i - 30):i + 30]!r}"
        if err is None:
            assert _identical(got, tree), f"{where} loaded other values"
        else:
            refused += 1
            assert str(root) in err and DAMAGED in err, f"{where}: {err}"
    assert refused > 100
    # A block missing: the elements not covered are named.
    blocks = json.loads(raw)
    bpath.write_text(json.dumps([b for b in blocks if not (b["path"] == "a" and b["start"] == [2, 0])]))
    _, err = _load_or_error(root, tree, specs, mesh)
    assert err is not None and "'a' [4, 6] cover 12 of its 24 elements: none holds the element at [2, 0]" in err, err
    # The blocks of a leaf that overlap and leave a gap, with the volumes adding up.
    second = next(b for b in blocks if b["path"] == "a" and b["start"] == [2, 0])
    second["start"] = [1, 0]
    bpath.write_text(json.dumps(blocks))
    _, err = _load_or_error(root, tree, specs, mesh)
    assert err is not None and "blocks-00000.json" in err and "'a'" in err and "overlap" in err, err


def test_a_block_whose_bytes_do_not_fit_its_box_is_named(tmp_path):
    """A block's shape edited so that its bytes cannot be its box: an error naming the
    file, the leaf and what to do (before: RuntimeError: shape '[2, 7]' is invalid for
    input of size 12)."""
    root = tmp_path / "ck"
    tree, specs, mesh = _small(root)
    _unsealed(root)
    bpath = root / "blocks-00000.json"
    blocks = json.loads(bpath.read_text())
    next(b for b in blocks if b["path"] == "a" and b["start"] == [2, 0])["shape"] = [2, 7]
    bpath.write_text(json.dumps(blocks))
    _, err = _load_or_error(root, tree, specs, mesh)
    assert err is not None and str(bpath) in err and "'a'" in err and DAMAGED in err, err


# -- a checkpoint of another model ------------------------------------------------------------------


def test_another_model_is_summarised_in_one_line_before_the_details(tmp_path):
    from fsharded.models import gpt

    big = gpt.init(gpt.GPTConfig(vocab_size=64, seq_len=16, n_layers=4, d_model=32, n_heads=2), 0)
    small = gpt.init(gpt.GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=16, n_heads=2), 0)
    mesh = fs.Mesh({"data": 1})
    fs.checkpoint.save(tmp_path / "ck", {"params": big}, P(), mesh)
    with pytest.raises(CheckpointError) as e:
        fs.checkpoint.load(tmp_path / "ck", {"params": small}, P(), mesh)
    lines = str(e.value).splitlines()
    first = lines[0]
    assert str(tmp_path / "ck") in first
    assert "4 layers d_model=32" in first and "2 layers d_model=16" in first, first
    assert f"{gpt.param_count(big):,} params" in first and f"{gpt.param_count(small):,} params" in first
    assert "68 leaves" in first and "36 leaves" in first
    # 32 extra and 32 mis-shaped leaves: a few of each, then a count.
    assert len(lines) < 30 and any("more" in line for line in lines), lines
    assert any(line.strip().startswith("extra: params.blocks.2") for line in lines)
    assert "--set model." in str(e.value) or "the model it was saved from" in str(e.value)


# -- two runs on one save directory ---------------------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import sys, torch, fsharded as fs
    from fsharded import P
    mgr = fs.checkpoint.Manager(sys.argv[1])
    mgr.save(1, {"w": torch.ones(2)}, P(), fs.Mesh({"data": 1}))
    print("locked", flush=True)
    sys.stdin.read()  # holds the directory until the test closes stdin
""")


def _holder(tmp_path, root) -> subprocess.Popen:
    script = tmp_path / "holder_run.py"
    script.write_text(_HOLDER)
    p = subprocess.Popen([sys.executable, str(script), str(root)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().strip() == "locked"
    return p


def _save(mgr, n, value=1.0):
    return mgr.save(n, {"w": torch.full((2,), value)}, P(), fs.Mesh({"data": 1}))


def test_a_second_manager_of_a_directory_in_use_is_refused_naming_the_first(tmp_path):
    root = tmp_path / "run"
    first, second = fs.checkpoint.Manager(root), fs.checkpoint.Manager(root)
    _save(first, 1)
    with pytest.raises(OSError, match=rf"{root} is in use by another run: pid {os.getpid()} "):
        _save(second, 2, 2.0)
    assert first.steps() == [1]
    _save(first, 2)
    first.unlock()
    _save(second, 3)  # free again
    assert second.steps() == [1, 2, 3]
    second.unlock()
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002", "step-00000003"]


@pytest.mark.multiprocess
def test_another_process_holding_the_directory_is_named_and_a_dead_ones_lock_taken_over(tmp_path):
    root = tmp_path / "run"
    p = _holder(tmp_path, root)
    try:
        with pytest.raises(OSError) as e:
            _save(fs.checkpoint.Manager(root), 2)
        msg = str(e.value)
        assert f"pid {p.pid}" in msg and "holder_run.py" in msg and "--save-dir" in msg, msg
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean exit left no stale lock to warn of
        mgr = fs.checkpoint.Manager(root)
        _save(mgr, 2)
        mgr.unlock()
    p = _holder(tmp_path, root)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    mgr = fs.checkpoint.Manager(root)
    with pytest.warns(UserWarning, match=rf"took over the lock .* pid {p.pid}.*no longer running"):
        _save(mgr, 3)
    assert mgr.steps() == [1, 2, 3]
    mgr.unlock()


@pytest.mark.multiprocess
def test_two_gloo_ranks_hold_one_lock_and_both_learn_it_is_taken(tmp_path):
    import faults_ckpt_cases as F

    from fsharded.testing import run_on_ranks

    root = str(tmp_path / "run")
    mine = fs.checkpoint.Manager(root)
    mine.lock()
    res = run_on_ranks(F.save_under_lock, 2, root)
    for r in res:
        assert r["error"] is not None and f"pid {os.getpid()}" in r["error"], r
    mine.unlock()
    res = run_on_ranks(F.save_under_lock, 2, root)
    assert [r["error"] for r in res] == [None, None]
    for r in res:  # one lock for the job, rank 0's
        assert json.loads(r["lock"])["pid"] == res[0]["pid"]
    assert fs.checkpoint.Manager(root).steps() == [1]


TINY = ["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "6", "--set", "data=stdlib:300000"]


@pytest.mark.multiprocess
def test_fsharded_train_on_a_save_dir_in_use_is_refused_naming_the_other_run(tmp_path):
    root = tmp_path / "ck"
    p = _holder(tmp_path, root)
    try:
        r = subprocess.run([sys.executable, "-m", "fsharded", "train", *TINY, "--save-every", "3",
                            "--save-dir", str(root)], capture_output=True, text=True, timeout=300, env=ENV)
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert f"pid {p.pid}" in r.stderr and "holder_run.py" in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(root)) == ["step-00000001"]  # the holder's, untouched


# -- an overwrite interrupted between its two renames --------------------------------------------------

_KILLED_BETWEEN_RENAMES = textwrap.dedent("""
    import os, signal, sys, torch, fsharded as fs
    from fsharded import P
    mgr = fs.checkpoint.Manager(sys.argv[1], keep=3)
    mesh = fs.Mesh({"data": 2})
    mgr.save(2, {"w": torch.full((4, 4), 1.0)}, P("data"), mesh)
    real = os.rename
    def rename(src, dst):
        if ".tmp-" in os.fspath(src):  # the new checkpoint into place: killed just before
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)
    os.rename = rename
    mgr.save(2, {"w": torch.full((4, 4), 2.0)}, P("data"), mesh)
""")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run directory whose step-2 overwrite was killed between its two renames."""
    root = tmp_path_factory.mktemp("interrupted") / "run"
    r = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_RENAMES, str(root)], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    names = sorted(n for n in os.listdir(root) if not n.startswith("."))
    assert len(names) == 2 and names[0].startswith("step-00000002.old-") and \
        names[1].startswith("step-00000002.tmp-"), names
    return root


def _copy(src, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _w(path):
    return fs.checkpoint.load(path, {"w": torch.empty(4, 4)}, P(), fs.Mesh({"data": 1}))["w"]


def test_a_load_completes_an_overwrite_interrupted_between_its_renames(interrupted, tmp_path):
    root = _copy(interrupted, tmp_path)
    with pytest.warns(UserWarning, match=r"step-00000002 .*interrupted between its two renames.*completed"):
        w = _w(root / "step-00000002")
    assert torch.equal(w, torch.full((4, 4), 2.0))  # the new save, which was complete
    assert "step-00000002" in os.listdir(root)


def test_a_manager_lists_and_keeps_an_interrupted_overwrite(interrupted, tmp_path):
    """Before: latest() was None, and the next save removed the old copy (the new one was
    left as an 'incomplete' temporary directory): step 2 was lost."""
    root = _copy(interrupted, tmp_path)
    mgr = fs.checkpoint.Manager(root, keep=3)
    with pytest.warns(UserWarning, match="interrupted between its two renames"):
        assert mgr.latest() == mgr.path(2)
    _save_w = mgr.save(4, {"w": torch.full((4, 4), 4.0)}, P("data"), fs.Mesh({"data": 2}))
    assert _save_w == mgr.path(4) and mgr.steps() == [2, 4]
    fs.checkpoint._api._wait_removals()
    assert torch.equal(_w(mgr.path(2)), torch.full((4, 4), 2.0))
    mgr.unlock()
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000004"]  # the replaced one removed


def test_the_next_save_after_an_interrupted_overwrite_keeps_a_copy(interrupted, tmp_path):
    """The next save going straight through the Manager (no listing first) must not
    delete the old copy while the new one is not in place."""
    root = _copy(interrupted, tmp_path)
    mgr = fs.checkpoint.Manager(root, keep=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.save(4, {"w": torch.full((4, 4), 4.0)}, P("data"), fs.Mesh({"data": 2}))
        fs.checkpoint._api._wait_removals()
        assert torch.equal(_w(mgr.path(2)), torch.full((4, 4), 2.0))
    mgr.unlock()


def test_an_interrupted_swap_without_a_complete_new_save_rolls_back(tmp_path):
    root = tmp_path / "ck"
    fs.checkpoint.save(root, {"w": torch.full((4, 4), 1.0)}, P(), fs.Mesh({"data": 1}))
    os.rename(root, f"{root}.old-0badf00d")
    os.makedirs(f"{root}.tmp-0badf00d")  # the new save never got its manifest
    with pytest.warns(UserWarning, match=r"restored the previous .*old-0badf00d"):
        assert torch.equal(_w(root), torch.full((4, 4), 1.0))
    os.makedirs(tmp_path / "gone.tmp-12345678")
    with pytest.raises(FileNotFoundError, match=r"gone.tmp-12345678 .* is an incomplete save"):
        _w(tmp_path / "gone")


def test_a_save_whose_swap_another_process_completed_succeeds(tmp_path, monkeypatch):
    """A reader completing the swap (between the saver's renames) leaves the saver's own
    rename nothing to move: the save is still a success."""
    from fsharded.checkpoint import _api as ck

    root = tmp_path / "ck"
    fs.checkpoint.save(root, {"w": torch.full((4, 4), 1.0)}, P(), fs.Mesh({"data": 1}))
    real, reads = os.rename, []

    def rename(src, dst):
        if ".tmp-" in os.fspath(src) and not reads:  # the saver's second rename: a reader first
            reads.append(src)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert torch.equal(_w(root), torch.full((4, 4), 2.0))  # completes the swap
        return real(src, dst)

    monkeypatch.setattr(ck.os, "rename", rename)
    assert fs.checkpoint.save(root, {"w": torch.full((4, 4), 2.0)}, P(), fs.Mesh({"data": 1}),
                              overwrite=True) == str(root)
    monkeypatch.undo()
    assert reads and torch.equal(_w(root), torch.full((4, 4), 2.0))


# -- resuming past a damaged newest checkpoint ----------------------------------------------------------


def _flip(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def _two_saves(root):
    step, params = C.make_step({"data": 2}, 3)
    mgr = fs.checkpoint.Manager(root, keep=3)
    state, saved = step.init(params), {}
    for i in range(4):
        state, _ = C.train(step, state, i, 1)
        if (i + 1) % 2 == 0:
            mgr.save_state(step, state)
            saved[i + 1] = C.global_state(step, state)
    mgr.unlock()
    return step, params, mgr, saved


def test_restore_falls_back_past_a_damaged_newest_checkpoint_naming_it(tmp_path):
    step, params, mgr, saved = _two_saves(tmp_path / "run")
    _flip(tmp_path / "run" / "step-00000004" / "data-00000.bin")
    with pytest.warns(UserWarning, match=r"step-00000004 .*damaged.*checksum mismatch"):
        path, state = mgr.restore(step, step.init(params))
    assert path == mgr.path(2) and C.leaves_equal(C.global_state(step, state), saved[2])
    # A damaged manifest: latest() passes over it too.
    m = tmp_path / "run" / "step-00000004" / "manifest.json"
    m.write_text(m.read_text().replace('"writers": 1', '"writers": 2'))
    with pytest.warns(UserWarning, match=r"step-00000004.*manifest.json"):
        assert mgr.latest() == mgr.path(2)
    # Every one damaged: an error naming each, not a run from step 0.
    _flip(tmp_path / "run" / "step-00000002" / "data-00000.bin")
    with pytest.raises(fs.checkpoint.CorruptCheckpointError, match=r"step-00000004[\s\S]*step-00000002"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr.restore(step, step.init(params))


def test_restore_does_not_fall_back_past_a_checkpoint_of_another_model(tmp_path):
    step, params, mgr, saved = _two_saves(tmp_path / "run")
    other, oparams = C.make_step({"data": 2}, 3)
    oparams = dict(oparams, w_in=torch.zeros(8, 32))
    with pytest.raises(CheckpointError, match="does not fit") as e:
        mgr.restore(other, other.init(oparams))
    assert not isinstance(e.value, fs.checkpoint.CorruptCheckpointError)


@pytest.mark.multiprocess
def test_ranks_agree_to_fall_back_when_one_rank_finds_its_blocks_damaged(tmp_path):
    """Only rank 1 reads data-00001.bin (its ZeRO-3 shards): both ranks must resume from
    the same (older) checkpoint."""
    import faults_ckpt_cases as F

    from fsharded.testing import run_on_ranks

    root = str(tmp_path / "run")
    saved = run_on_ranks(F.save_steps, 2, root)[0]
    _flip(tmp_path / "run" / "step-00000004" / "data-00001.bin")
    res = run_on_ranks(F.restore, 2, root)
    for r in res:
        assert r["path"] == os.path.join(root, "step-00000002"), r["path"]
        assert C.leaves_equal(r["state"], saved[2])
    assert any("step-00000004" in w and "data-00001.bin" in w for w in res[0]["warnings"]), res[0]["warnings"]


@pytest.mark.multiprocess
def test_fsharded_train_resume_latest_falls_back_past_a_damaged_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "fsharded", "train", *TINY, "--save-every", "3",
                        "--save-dir", str(ck)], capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    _flip(ck / "step-00000006" / "data-00000.bin")
    r = subprocess.run([sys.executable, "-m", "fsharded", "train", *TINY, "--save-every", "3",
                        "--save-dir", str(ck), "--resume", "latest"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "at step 3" in r.stdout, r.stdout[-2000:]
    assert "step-00000006" in r.stderr and "checksum mismatch" in r.stderr, r.stderr[-2000:]
