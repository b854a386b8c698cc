"""The C++ extensions are built once per install and never inside a timed wait.

Their cache is keyed by a hash of the sources and everything the build depends on, so a
second install (another checkout, another venv) builds its own copy beside the first's and
neither rebuilds the other's; a finished build is loaded without compiling. Ranks needing
the shared-memory transport build it before the set-up's timed barrier, the first under a
file lock while the others wait for it untimed, so a short ``timeout_s`` does not fail a
correct program whose first run compiles it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import build_cache_cases as C
import pytest

from fsharded import _cext as _build


def _load_probe(csrc: Path, ext: Path) -> tuple[dict, str]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    out = subprocess.run([sys.executable, "-c", C.LOAD_PROBE, str(csrc)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_second_install_does_not_rebuild_the_first_ones_extension(tmp_path):
    ext = tmp_path / "torch_extensions"
    first, second = tmp_path / "install-a" / "csrc", tmp_path / "install-b" / "csrc"
    for d in (first, second):  # the same sources at two paths: two checkouts
        d.mkdir(parents=True)
        (d / "probe.cpp").write_text(C.PROBE_CPP)
    a, log_a = _load_probe(first, ext)
    b, _ = _load_probe(second, ext)
    again, log_again = _load_probe(first, ext)
    assert (again["file"], again["mtime"]) == (a["file"], a["mtime"]), \
        "the first install's build was rebuilt after the second install's"
    assert b["file"] != a["file"], "both installs build into one place"
    assert "fsharded: building fsharded_probe, once for this install" in log_a
    assert "building" not in log_again  # loaded from its cache: no compiler, no ninja run


def test_the_cache_key_covers_sources_flags_and_the_environment(tmp_path):
    (tmp_path / "x.cpp").write_text("int x;")
    (tmp_path / "x.h").write_text("// a header")
    base = _build.keyed_name("ext", ["x.cpp"], root=tmp_path, extra_cflags=["-O3"])
    assert base.startswith("ext_") and len(base) == len("ext_") + 12
    assert _build.keyed_name("ext", ["x.cpp"], root=tmp_path, extra_cflags=["-O3"]) == base  # stable
    others = [
        _build.keyed_name("ext", ["x.cpp"], root=tmp_path, extra_cflags=["-O2"]),
        _build.keyed_name("ext", ["x.cpp"], root=tmp_path, extra_cflags=["-O3"], extra_ldflags=["-lrt"]),
        _build.keyed_name("ext", ["x.cpp"], root=tmp_path, extra_cflags=["-O3"], prefix="/other/venv"),
        _build.keyed_name("ext", ["x.cpp"], root=tmp_path, extra_cflags=["-O3"], python="/other/python3"),
    ]
    (tmp_path / "x.h").write_text("// another header")
    others.append(_build.keyed_name("ext", ["x.cpp"], root=tmp_path, extra_cflags=["-O3"]))
    assert len({base, *others}) == len(others) + 1


def test_a_build_killed_while_holding_torchs_lock_does_not_hang_the_next(tmp_path):
    csrc, ext = tmp_path / "csrc", tmp_path / "ext"
    csrc.mkdir()
    (csrc / "probe.cpp").write_text(C.PROBE_CPP)
    keyed = _build.keyed_name("fsharded_probe", ["probe.cpp"], root=csrc)
    (ext / keyed).mkdir(parents=True)
    (ext / keyed / "lock").write_text("")  # what torch's builder leaves when killed mid-build
    a, _ = _load_probe(csrc, ext)  # (torch's own wait on it never ends)
    assert Path(a["file"]).parent == ext / keyed


def test_a_rank_whose_peer_is_building_does_not_time_out(tmp_path, capfd):
    from fsharded.comm import _shm
    from fsharded.testing import run_on_new_ranks

    mod, why = _shm._module()  # this install's real build, once (the ranks load it)
    if mod is None:
        pytest.skip(f"the shared-memory transport cannot be built here: {why}")
    capfd.readouterr()
    # The fake build takes 3x the group's timeout: on the set-up's timed barrier a waiting
    # rank would fail; waiting on the builder's file lock it does not.
    out = run_on_new_ranks(C.slow_peer_build, 2, str(tmp_path), 6.0, 2.0)
    err = capfd.readouterr().err
    for r in out:
        assert r["sum"] == [3.0] * 4 and r["shm"], r
    assert "fsharded: building the shared-memory transport, once for this install, ~15 s" in err, err
