"""The tools and the app live in fsharded.tools; their old module names (fsharded.memory,
fsharded.train, ...) are the same module objects, imported on first use, with no files left
in the package root."""

from __future__ import annotations

import importlib
import pathlib
import pickle
import subprocess
import sys

import pytest

import fsharded as fs
from fsharded import _moved

ROOT = pathlib.Path(fs.__file__).parent
OLD = ["cli", "train", "_train_resume", "plot", "timeline", "visualize", "flops", "memory", "data", "demo"]


def test_the_table_is_every_module_of_tools():
    have = sorted(p.stem for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__")
    # every moved module is here; what tools gained since is private (no old name to keep)
    assert set(OLD) <= set(have) and all(n.startswith("_") for n in set(have) - set(OLD)), have
    assert _moved.MOVED == {f"fsharded.{n}": f"fsharded.tools.{n}" for n in OLD}


@pytest.mark.parametrize("name", OLD)
def test_an_old_name_is_the_new_module(name):
    assert not (ROOT / f"{name}.py").exists()  # no shim in the root
    old = importlib.import_module(f"fsharded.{name}")
    new = importlib.import_module(f"fsharded.tools.{name}")
    assert old is new and sys.modules[f"fsharded.{name}"] is new
    assert getattr(fs, name) is new  # the parent's attribute, as after any submodule import
    # the module keeps its own name and spec (reload, pickling and doctest see the new one)
    assert new.__name__ == new.__spec__.name == f"fsharded.tools.{name}"


def test_the_public_names_of_the_moved_modules():
    import fsharded.memory as m
    from fsharded.memory import track
    from fsharded.train import main

    assert m is fs.tools.memory is fs.memory and track is fs.memory.track
    assert fs.timeline is fs.tools.timeline and fs.data is fs.tools.data
    assert fs.visualize_sharding is fs.tools.visualize.visualize_sharding
    assert main is fs.tools.train.main
    for name in ("memory", "timeline", "data"):
        assert name in fs.__all__


def test_classes_pickle_under_the_new_name_and_load_under_the_old():
    from fsharded.data import Tokens

    assert Tokens.__module__ == "fsharded.tools.data"
    assert pickle.loads(pickle.dumps(Tokens)) is Tokens
    # what a pickle written before the move holds: the class under its old module name
    old = pickle.dumps(Tokens, protocol=2).replace(b"fsharded.tools.data", b"fsharded.data")
    assert b"fsharded.data" in old and pickle.loads(old) is Tokens


def test_the_console_script_names_the_new_module():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"fsharded": "fsharded.tools.cli:main"}


def test_importing_fsharded_stays_light_and_imports_old_names_only_when_asked():
    code = ("import sys, fsharded\n"
            "heavy = [m for m in ('matplotlib', 'transformers', 'deepspeed', 'triton') if m in sys.modules]\n"
            "old = [m for m in fsharded._moved.MOVED if m in sys.modules]\n"
            "import fsharded.plot, importlib\n"
            "assert importlib.reload(fsharded.plot) is fsharded.tools.plot\n"
            "print(heavy, old, 'fsharded.plot' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[] [] True"


def test_python_m_runs_a_moved_module_by_its_old_name():
    out = subprocess.run([sys.executable, "-m", "fsharded.demo", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tour of the SPMD core" in out.stdout


def test_the_device_mesh_interop_is_comms_and_the_mesh_methods_call_it():
    import torch

    class Stub:  # what from_device_mesh reads of a DeviceMesh (no process group here)
        mesh_dim_names = ("data", "tensor")
        mesh = torch.arange(4).reshape(2, 2)
        device_type = "cpu"

    want = fs.Mesh({"data": 2, "tensor": 2})
    assert fs.comm.from_device_mesh(Stub()) == want == fs.Mesh.from_torch(Stub())
    assert fs.comm.from_device_mesh(Stub()).device_type == "cpu"
    Stub.mesh_dim_names = None
    with pytest.raises(ValueError, match="mesh_dim_names"):
        fs.comm.from_device_mesh(Stub())
