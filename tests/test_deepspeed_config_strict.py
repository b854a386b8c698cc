"""A DeepSpeed config behaves as a DeepSpeed user expects: ``steps_per_print`` and ``seed``
reach `fsharded train`; a feature fsharded does not have yet (offload, activation
checkpointing, the flops profiler...) is refused by name unless ``allow_ignored`` /
``--allow-ignored``; its off values are read without a word; and the config warning prints
as its message alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from fsharded import train
from fsharded.config import ConfigWarning, from_deepspeed

# The tiny GPT on 300 kB of text: a step takes milliseconds, a run of a few steps a second.
TINY = ["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
DS = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _ds_file(tmp_path, **extra) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS, **extra}))
    return str(path)


def _main(args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = train.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def _printed_steps(out: str) -> list[int]:
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]


# -- steps_per_print and seed reach the job ---------------------------------------------------


def test_steps_per_print_sets_the_steps_printed(tmp_path, capsys):
    ds = _ds_file(tmp_path, steps_per_print=2)
    code, out, err = _main([*TINY, "--steps", "6", "--deepspeed-config", ds], capsys)
    assert code == 0, err
    assert _printed_steps(out) == [1, 2, 4, 6]
    # --set comes last, as for every other setting the config gives.
    code, out, err = _main([*TINY, "--steps", "6", "--deepspeed-config", ds, "--set", "log_every=3"], capsys)
    assert code == 0, err
    assert _printed_steps(out) == [1, 3, 6]


def test_deepspeed_settings_of_the_run_count_only_when_given(tmp_path):
    def cfg(*args):
        return train.make_config(train.build_parser().parse_args([*TINY, *args]))

    toml = tmp_path / "run.toml"
    toml.write_text("log_every = 4\nseed = 5\n")
    given = _ds_file(tmp_path, steps_per_print=2, seed=7)
    c = cfg("--config", str(toml), "--deepspeed-config", given)
    assert (c.log_every, c.seed) == (2, 7)  # the DeepSpeed config is read after --config
    c = cfg("--deepspeed-config", given, "--seed", "9", "--set", "log_every=6")
    assert (c.log_every, c.seed) == (6, 9)  # flags and --set after it
    absent = tmp_path / "absent.json"
    absent.write_text(json.dumps({**DS, "steps_per_print": "auto"}))
    with pytest.warns(ConfigWarning, match="steps_per_print"):
        c = cfg("--config", str(toml), "--deepspeed-config", str(absent))
    assert (c.log_every, c.seed) == (4, 5)  # not given ("auto" is unset): --config's stand


# -- features fsharded does not have: refused by name, unless allowed ------------------------

ASKED = [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio = 0.3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device = 'cpu'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
     "zero_optimization.offload_param.device = 'nvme'"),
    ({"zero_optimization": {"stage": 3, "cpu_offload_params": True}},
     "zero_optimization.cpu_offload_params = True"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights = True"),
    ({"flops_profiler": {"enabled": True, "profile_step": 1, "detailed": True}}, "flops_profiler.enabled = True"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled = True"),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast.enabled = True"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity.enabled = True"),
    ({"quantize_training": {"enabled": True}}, "quantize_training.enabled = True"),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}}, "curriculum_learning.enabled = True"),
    ({"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True}}}, "data_efficiency.enabled = True"),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "progressive_layer_drop.enabled = True"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad = True"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "last_batch_iteration": 99}}},
     "scheduler.params.last_batch_iteration = 99"),
]


@pytest.mark.parametrize("extra, key", ASKED, ids=[k.split(" ")[0] for _, k in ASKED])
def test_a_feature_asked_for_is_refused_by_name_unless_allowed(extra, key):
    ds = {**DS, "train_batch_size": 8, **extra}
    with pytest.raises(ValueError) as e:
        from_deepspeed(ds, data_parallel_size=2)
    msg = str(e.value)
    assert "settings fsharded does not support yet" in msg and key in msg, msg
    assert "allow_ignored=True" in msg and "--allow-ignored" in msg, msg  # what to do
    with pytest.warns(ConfigWarning) as rec:
        cfg = from_deepspeed(ds, data_parallel_size=2, allow_ignored=True)
    msg = "\n".join(str(w.message) for w in rec)
    assert "ignored (allow_ignored)" in msg and key in msg, msg
    assert cfg.train_batch_size == 8


def test_the_run_is_refused_unless_allow_ignored(tmp_path, capsys):
    ds = _ds_file(tmp_path, zero_optimization={"stage": 1, "offload_param": {"device": "cpu"}},
                  progressive_layer_drop={"enabled": True}, flops_profiler={"enabled": True})
    code, out, err = _main([*TINY, "--steps", "2", "--deepspeed-config", ds], capsys)
    assert code == 2 and "step " not in out
    for key in ("zero_optimization.offload_param.device = 'cpu'",
                "progressive_layer_drop.enabled = True", "flops_profiler.enabled = True",
                "--allow-ignored"):
        assert key in err, err
    with pytest.warns(ConfigWarning, match=r"(?s)ignored \(allow_ignored\).*offload_param\.device.*"
                                           r"flops_profiler\.enabled.*progressive_layer_drop\.enabled"):
        code, out, err = _main([*TINY, "--steps", "2", "--deepspeed-config", ds, "--allow-ignored"], capsys)
    assert code == 0 and "done: loss" in out, err


OFF = [
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
                           "offload_param": {"device": "none", "nvme_path": None}}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": None, "offload_param": None, "cpu_offload": False}},
    {"activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                  "contiguous_memory_optimization": False, "number_checkpoints": None,
                                  "synchronize_checkpoint_boundary": False, "profile": False}},
    {"flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                        "detailed": True, "output_file": None}},
    {"amp": {"enabled": False, "opt_level": "O1"}, "elasticity": {"enabled": False, "max_train_batch_size": 8}},
]


@pytest.mark.parametrize("extra", OFF, ids=["offload-none", "offload-null", "activation-checkpointing-off",
                                            "flops-profiler-off", "amp-elasticity-off"])
def test_a_feature_left_off_is_read_without_a_word(extra):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = from_deepspeed({**DS, "train_batch_size": 8, **extra}, data_parallel_size=2)
    assert cfg.train_batch_size == 8


def test_the_switches_keys_are_checked_like_any_other():
    base = {**DS, "train_batch_size": 8}
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.devcie: not a key fsharded "
                                         r"reads; did you mean zero_optimization\.offload_optimizer\.device\?"):
        from_deepspeed({**base, "zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}}, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_param\.device: expected one of "
                                         r"\"none\", \"cpu\", \"nvme\", got 'gpu'"):
        from_deepspeed({**base, "zero_optimization": {"offload_param": {"device": "gpu"}}}, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"flops_profiler\.enabled: expected bool, got 'yes'"):
        from_deepspeed({**base, "flops_profiler": {"enabled": "yes"}}, data_parallel_size=2)


# -- the warning prints as its message alone ---------------------------------------------------


def test_the_config_warning_prints_no_source_line(tmp_path):
    ds = _ds_file(tmp_path, my_key=1)
    r = subprocess.run([sys.executable, "-m", "fsharded", "train", *TINY, "--steps", "1", "--deepspeed-config",
                        ds], capture_output=True, text=True, timeout=240, env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("DeepSpeed config:\n  keys fsharded does not use (ignored):\n    my_key = 1\n"), \
        r.stderr
    for noise in ("warnings.warn", "train.py", "_deepspeed.py", "ConfigWarning:", "UserWarning"):
        assert noise not in r.stderr, r.stderr
