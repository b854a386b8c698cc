"""TrainConfig validation, files, overrides, and DeepSpeed JSON configs read into it."""

from __future__ import annotations

import json
import re
import sys
import warnings

import pytest
import torch

from fsharded.config import (
    ConfigWarning,
    LossScaleConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
    apply_overrides,
    from_deepspeed,
    load_config,
    parse_overrides,
)
from fsharded.precision import DynamicLossScale, Policy, StaticLossScale

# Shaped like the examples in DeepSpeed's config-json docs and tutorials.
DS_FP16_ZERO2 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 50,
    "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "betas": [0.8, 0.999], "eps": 1e-8,
                                              "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.5e-4,
                                                  "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True},
    "wall_clock_breakdown": False,
}
DS_BF16_ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 8,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000, "warmup_num_steps": 100,
                                                        "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e7},
    "communication_data_type": "bf16",
    "seed": 1234,
}
DS_SGD_ONECYCLE = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                             "dampening": 0.0}},
    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                  "cycle_first_step_size": 500,
                                                  "cycle_second_step_size": None}},
    "zero_optimization": True,  # DeepSpeed's deprecated form: stage 1
}


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the realistic configs above must not warn
        return fn(*args, **kw)


# -- from_deepspeed -------------------------------------------------------------------------


def test_fp16_zero2_config():
    cfg = _quiet(from_deepspeed, DS_FP16_ZERO2, data_parallel_size=4)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps) == (64, 4, 4)
    assert cfg.mesh == {"data": 4} and cfg.zero_stage == 2 and cfg.grad_clip == 1.0
    assert cfg.log_every == 50 and cfg.precision == "fp16"
    # DeepSpeed's "Adam" runs AdamW (adam_w_mode defaults to true)
    assert cfg.optimizer == OptimizerConfig(name="adamw", lr=1.5e-4, betas=(0.8, 0.999), eps=1e-8,
                                            weight_decay=3e-7)
    assert cfg.scheduler == SchedulerConfig(
        "WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.5e-4, "warmup_num_steps": 1000})
    assert cfg.loss_scaler() == DynamicLossScale()
    assert cfg.policy() == Policy.fp16(loss_scale=DynamicLossScale())


def test_bf16_zero3_config():
    cfg = _quiet(from_deepspeed, DS_BF16_ZERO3, data_parallel_size=2)  # tuning knobs: quiet
    # The optimizer state offloaded to host memory, pinned, as the config asks.
    assert cfg.offload.optimizer == "cpu" and cfg.offload.pin_memory
    assert cfg.offload.zero_kwargs()["offload_optimizer"] == "cpu"
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps) == (32, 2, 8)
    assert cfg.precision == "bf16" and cfg.loss_scaler() is None and cfg.zero_stage == 3
    assert cfg.seed == 1234 and cfg.optimizer.eps == 1e-8  # FusedAdam's default filled in
    assert cfg.policy() == Policy.bf16(reduce_dtype=torch.bfloat16)
    assert cfg.scheduler.params == {"total_num_steps": 5000, "warmup_num_steps": 100,
                                    "warmup_type": "linear"}


def test_sgd_onecycle_config_with_legacy_zero_flag():
    cfg = _quiet(from_deepspeed, DS_SGD_ONECYCLE)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps) == (16, 8, 2)
    assert cfg.zero_stage == 1 and cfg.precision == "fp32"
    assert cfg.optimizer == OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True,
                                            extra={"dampening": 0.0})
    assert cfg.scheduler.params["cycle_second_step_size"] is None


@pytest.mark.parametrize("typ, adam_w_mode, want", [
    ("Adam", None, "adamw"), ("Adam", False, "adam"), ("adamw", False, "adamw"), ("AdamW", None, "adamw"),
])
def test_adam_means_adamw_unless_adam_w_mode_is_false(typ, adam_w_mode, want):
    params = {} if adam_w_mode is None else {"adam_w_mode": adam_w_mode}
    cfg = _quiet(from_deepspeed, {"train_batch_size": 1, "optimizer": {"type": typ, "params": params}})
    assert cfg.optimizer.name == want and cfg.optimizer.lr == 1e-3


def test_omitted_optimizer_settings_take_deepspeeds_defaults():
    lion = _quiet(from_deepspeed, {"train_batch_size": 1, "optimizer": {"type": "Lion"}})
    assert lion.optimizer == OptimizerConfig(name="lion", lr=1e-3, betas=(0.9, 0.999))
    ada = _quiet(from_deepspeed, {"train_batch_size": 1, "optimizer": {"type": "Adagrad"}})
    assert (ada.optimizer.lr, ada.optimizer.eps) == (1e-2, 1e-10)
    lamb = {"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {"max_coeff": 10.0,
                                                                         "min_coeff": 0.01}}}
    assert _quiet(from_deepspeed, lamb).optimizer.eps == 1e-8  # FusedLamb's, not 1e-6
    lamb["optimizer"]["params"]["max_coeff"] = 0.3  # not modelled: only the default is accepted
    with pytest.raises(ValueError, match=r"optimizer\.params\.max_coeff = 0\.3: fsharded has it only at"):
        from_deepspeed(lamb)
    with pytest.warns(ConfigWarning, match=r"optimizer\.params\.max_coeff = 0\.3"):
        from_deepspeed(lamb, allow_ignored=True)


def test_scheduler_defaults_follow_deepspeed():
    ds = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    assert _quiet(from_deepspeed, ds).scheduler.params["warmup_max_lr"] == 2e-4  # the optimizer's lr
    ds["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3}}
    with pytest.warns(ConfigWarning, match="OneCycle: DeepSpeed also cycles beta1"):
        from_deepspeed(ds)
    ds["scheduler"]["params"]["cycle_momentum"] = False
    assert _quiet(from_deepspeed, ds).scheduler.name == "OneCycle"


def test_static_loss_scale():
    cfg = _quiet(from_deepspeed, {"train_batch_size": 1, "optimizer": {"type": "Adam"},
                                  "fp16": {"enabled": True, "loss_scale": 128}})
    assert cfg.loss_scaler() == cfg.policy().loss_scaler() == StaticLossScale(128.0)


@pytest.mark.parametrize("given, dp, want", [
    # (train, micro, accum) -> derived triple, DeepSpeed's rules
    ((32, 4, None), 2, (32, 4, 4)),
    ((32, None, 4), 2, (32, 4, 4)),
    ((None, 4, 4), 2, (32, 4, 4)),
    ((32, None, None), 2, (32, 16, 1)),
    ((None, 4, None), 2, (8, 4, 1)),
    ((32, 4, 4), 2, (32, 4, 4)),
])
def test_batch_triple_derivation(given, dp, want):
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ds = {k: v for k, v in zip(keys, given) if v is not None}
    ds["optimizer"] = {"type": "AdamW"}
    cfg = _quiet(from_deepspeed, ds, data_parallel_size=dp)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps) == want
    ours = dict(zip(("train_batch_size", "micro_batch_size", "grad_accum_steps"), given))
    tc = TrainConfig(mesh={"data": dp}, **{k: v for k, v in ours.items() if v is not None})
    assert (tc.train_batch_size, tc.micro_batch_size, tc.grad_accum_steps) == want


def test_batch_arithmetic_error_shows_the_arithmetic():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW"}}
    with pytest.raises(ValueError) as e:
        from_deepspeed(ds, data_parallel_size=2)
    assert ("train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 "
            "* data parallel size 2 = 16") in str(e.value)
    with pytest.raises(ValueError, match=r"30 != .* 4 \* gradient_accumulation_steps 3 .* = 24 "
                                         r"\(gradient_accumulation_steps derived as 30 // 4"):
        from_deepspeed({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
                       data_parallel_size=2)
    with pytest.raises(ValueError, match="either train_batch_size or train_micro_batch_size_per_gpu"):
        from_deepspeed({"gradient_accumulation_steps": 2})


def test_data_parallel_size_is_implied_by_a_full_triple_or_taken_from_mesh():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW"}}
    assert _quiet(from_deepspeed, ds).mesh == {"data": 4}
    cfg = _quiet(from_deepspeed, {**ds, "gradient_accumulation_steps": 4},
                 mesh={"tensor": 2, "data": 2}, steps=10)
    assert cfg.mesh == {"tensor": 2, "data": 2} and cfg.steps == 10
    with pytest.raises(ValueError, match="not a multiple of .* = 8, so no data parallel size fits"):
        from_deepspeed({**ds, "train_batch_size": 30})
    with pytest.raises(ValueError, match="data_parallel_size 4 != mesh\\['data'\\] 2"):
        from_deepspeed(ds, data_parallel_size=4, mesh={"data": 2})


def test_unknown_keys_warn_by_path_and_auto_counts_as_unset():
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
          "gradient_clipping": "auto", "my_typo": 1, "tensorboard": {"enabled": True, "output_path": "x"},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "bogus": 3}},
          "fp16": {"enabled": False}}
    with pytest.warns(ConfigWarning) as rec:
        cfg = from_deepspeed(ds)
    msg = "\n".join(str(w.message) for w in rec)
    for path in ("my_typo = 1", "tensorboard", "optimizer.params.bogus = 3"):
        assert path in msg
    assert "tensorboard.enabled" not in msg  # a block nothing was read from is named once
    assert "treated as unset: train_batch_size, gradient_clipping" in msg
    assert (cfg.train_batch_size, cfg.grad_clip) == (2, 0.0)


def test_wrong_types_are_errors_naming_path_value_and_type():
    ds = {"train_batch_size": "32", "fp16": {"enabled": "yes", "hysteresis": 0, "loss_scale_window": 1.5},
          "optimizer": {"type": "OneBitAdam", "params": {"max_grad_norm": 1.0}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "10"}},
          "zero_optimization": {"stage": 4}}
    with pytest.raises(ValueError) as e:
        from_deepspeed(ds)
    msg = str(e.value)
    for line in ("train_batch_size: expected int, got '32' (str)",
                 "fp16.enabled: expected bool, got 'yes' (str)",
                 "fp16.hysteresis: expected an int >= 1, got 0",
                 "fp16.loss_scale_window: expected int, got 1.5 (float)",
                 "optimizer.type: 'OneBitAdam' is not supported",
                 "optimizer.params.max_grad_norm: not an optimizer parameter",
                 "scheduler.params.warmup_num_steps: expected int, got '10' (str)",
                 "scheduler.params.total_num_steps: required by WarmupDecayLR",
                 "zero_optimization.stage: expected an int in 0..3, got 4"):
        assert line in msg, line
    with pytest.raises(ValueError, match="fp16 and bf16 cannot both be enabled"):
        from_deepspeed({"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_reads_json_files_and_text(tmp_path):
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps(DS_FP16_ZERO2))
    assert _quiet(from_deepspeed, p, data_parallel_size=4) == _quiet(from_deepspeed, str(p),
                                                                     data_parallel_size=4)
    assert _quiet(from_deepspeed, json.dumps(DS_SGD_ONECYCLE)).zero_stage == 1
    p.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match="duplicate key 'train_batch_size'"):
        from_deepspeed(p)
    p.write_text('{"train_batch_size": 8, // comment\n}')
    with pytest.raises(ValueError, match="not valid JSON.*hjson"):
        from_deepspeed(p)
    with pytest.raises(FileNotFoundError):
        from_deepspeed(tmp_path / "missing.json")


# -- TrainConfig ----------------------------------------------------------------------------


def test_defaults_and_derived_fields():
    cfg = TrainConfig()
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps) == (1, 1, 1)
    assert cfg.policy() == Policy.fp32() and cfg.loss_scaler() is None
    cfg = TrainConfig(precision="fp16", loss_scale={"loss_scale_window": 10, "hysteresis": 1})
    assert cfg.loss_scaler() == DynamicLossScale(loss_scale_window=10, hysteresis=1)
    assert "optimizer.lr = 0.0003" in str(cfg)


def test_validation_lists_every_bad_field():
    with pytest.raises(ValueError) as e:
        TrainConfig(steps=0, mesh={"data": 0}, precision="fp8", grad_clip=-1, zero_stage=5,
                    optimizer={"name": "adamx", "lr": -1.0, "betas": [0.9], "extra": {"foo": 1}},
                    loss_scale=LossScaleConfig(hysteresis=1), scheduler={"name": "cosine"})
    msg = str(e.value)
    for line in ("steps: expected an int >= 1, got 0",
                 "mesh: expected a dict of axis name -> int >= 1, got {'data': 0}",
                 "precision: expected one of fp32, bf16, fp16, got 'fp8'",
                 "grad_clip: expected a finite number >= 0, got -1.0",
                 "zero_stage: expected an int in 0..3, got 5",
                 "optimizer.name: expected one of adamw, adam, sgd, lion, adagrad, lamb, got 'adamx'",
                 "optimizer.lr: expected a finite number >= 0, got -1.0",
                 "optimizer.betas: expected a pair of floats or None, got [0.9] (list)",
                 "scheduler.name: expected one of constant, linear, WarmupLR"):
        assert line in msg, line
    with pytest.raises(ValueError, match="steps: expected int, got '10' \\(str\\)"):
        TrainConfig(steps="10")
    with pytest.raises(ValueError, match=r"optimizer.extra.amsgrad: not a setting of sgd"):
        OptimizerConfig(name="sgd", extra={"amsgrad": True})
    with pytest.raises(ValueError, match=r"scheduler.params.warmup_num_step: not a parameter of "
                                         r"WarmupLR \(did you mean 'warmup_num_steps'\?\)"):
        SchedulerConfig("warmuplr", {"warmup_num_step": 3})


def test_batch_mismatch_in_train_config_shows_arithmetic():
    with pytest.raises(ValueError, match=r"train_batch_size 32 != micro_batch_size 4 \* grad_accum_steps"
                                         r" 2 \* data parallel size \(mesh\['data'\] x mesh\['expert'\]\) 2 = 16"):
        TrainConfig(train_batch_size=32, micro_batch_size=4, grad_accum_steps=2, mesh={"data": 2})


def test_replace_rederives_the_batch():
    cfg = TrainConfig(mesh={"data": 2}, micro_batch_size=4, grad_accum_steps=2)
    assert cfg.replace(micro_batch_size=8).train_batch_size == 32
    assert cfg.replace(mesh={"data": 4}).train_batch_size == 32
    assert cfg.replace(train_batch_size=64).grad_accum_steps == 8
    assert cfg.replace(train_batch_size=64, grad_accum_steps=4).micro_batch_size == 8
    assert cfg.replace(steps=5).train_batch_size == 16
    with pytest.raises(ValueError, match="unknown TrainConfig field.*'step'.*did you mean 'steps'"):
        cfg.replace(step=5)


def test_round_trip_through_dict_and_json():
    cfg = _quiet(from_deepspeed, DS_FP16_ZERO2, data_parallel_size=4, model={"n_layer": 2})
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# -- files and overrides --------------------------------------------------------------------

TOML = """
steps = 200
precision = "bf16"
micro_batch_size = 8
grad_accum_steps = 2
seq_len = 128

[model]
preset = "tiny"
n_layer = 2

[mesh]
data = 2
tensor = 1

[optimizer]
name = "adamw"
lr = 3e-4
betas = [0.9, 0.95]

[scheduler]
name = "WarmupCosineLR"
params = { total_num_steps = 200, warmup_num_steps = 20 }
"""


def test_load_toml_and_json(tmp_path):
    pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    p = tmp_path / "run.toml"
    p.write_text(TOML)
    cfg = load_config(p)
    assert cfg.train_batch_size == 32 and cfg.mesh == {"data": 2, "tensor": 1}
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.model == {"preset": "tiny", "n_layer": 2}
    assert cfg.scheduler.params["warmup_num_steps"] == 20
    j = tmp_path / "run.json"
    j.write_text(json.dumps(cfg.to_dict()))
    assert load_config(j) == cfg
    assert load_config(p, overrides=["optimizer.lr=1e-3"]).optimizer.lr == 1e-3
    p.write_text(TOML.replace("seq_len", "seqlen"))
    with pytest.raises(ValueError, match=r"(?s)run.toml: .*seqlen: unknown key \(did you mean 'seq_len'\?\)"):
        load_config(p)
    j.write_text(json.dumps(DS_FP16_ZERO2))
    with pytest.raises(ValueError, match="looks like a DeepSpeed config: use .*from_deepspeed"):
        load_config(j)


def test_toml_without_tomllib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    p = tmp_path / "run.toml"
    p.write_text("steps = 1\n")
    with pytest.raises(ImportError, match=r"\(Python 3.11\+\) or the .tomli. package"):
        load_config(p)


def test_overrides_coerce_strings_to_field_types():
    cfg = TrainConfig(mesh={"data": 2}, micro_batch_size=4)
    out = apply_overrides(cfg, {
        "optimizer.lr": "1e-3", "optimizer.betas": "0.9,0.95", "optimizer.nesterov": "true",
        "steps": "50", "metrics_file": "none", "mesh.data": "4", "model.n_layer": "3",
        "model.act": "gelu", "scheduler.name": "WarmupLR", "scheduler.params.warmup_num_steps": "10",
        "loss_scale.min_loss_scale": "0.5", "grad_clip": 1, "reduce_dtype": "bf16",
    })
    assert out.optimizer.lr == 1e-3 and out.optimizer.betas == (0.9, 0.95) and out.optimizer.nesterov
    assert out.steps == 50 and out.metrics_file is None and out.grad_clip == 1.0
    assert out.mesh == {"data": 4} and out.train_batch_size == 16
    assert out.model == {"n_layer": 3, "act": "gelu"} and cfg.model == {}  # cfg untouched
    assert out.scheduler == SchedulerConfig("WarmupLR", {"warmup_num_steps": 10})
    assert out.loss_scale.min_loss_scale == 0.5 and out.policy().reduce_dtype == torch.bfloat16
    assert apply_overrides(cfg, ["seed=7", "data=/tmp/corpus.txt"]).seed == 7
    assert parse_overrides(["a.b = 1"]) == {"a.b": "1"}
    # model settings have no schema: none / None / null all read as None (dropless MoE)
    for text in ("none", "None", "null"):
        out = apply_overrides(cfg, {"model.moe.capacity_factor": text, "model.moe.experts": "8"})
        assert out.model == {"moe": {"capacity_factor": None, "experts": 8}}, text


def test_override_errors_list_every_bad_key():
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), {"optimizer.lrr": "1", "optimizer.lr": "abc", "stepz": "1",
                                        "optimizer": "adam", "steps": "0"})
    msg = str(e.value)
    assert "optimizer.lrr: unknown key (did you mean 'optimizer.lr'?)" in msg
    assert "optimizer.lr: cannot read 'abc' as float" in msg
    assert "stepz: unknown key (did you mean 'steps'?)" in msg
    assert "optimizer: is a section; set optimizer.<field> instead" in msg
    with pytest.raises(ValueError, match="steps: expected an int >= 1, got 0"):
        apply_overrides(TrainConfig(), {"steps": "0"})
    with pytest.raises(ValueError, match="expected key=value"):
        parse_overrides(["optimizer.lr"])


def test_misspelt_keys_inside_known_deepspeed_blocks_are_errors_with_a_suggestion():
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}
    for block, want in [({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae: not a key fsharded "
                         "reads; did you mean zero_optimization.stage?"),
                        ({"fp16": {"enabeld": True}}, "did you mean fp16.enabled?"),
                        ({"fp16": {"enabled": True, "loss_scal": 0}}, "did you mean fp16.loss_scale?"),
                        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas1": [0.9, 0.99]}}},
                         "did you mean optimizer.params.betas?")]:
        with pytest.raises(ValueError, match=re.escape(want)):
            from_deepspeed({**base, **block}, data_parallel_size=2)
    # An unrelated unknown key is still only a warning, by its full path.
    with pytest.warns(ConfigWarning, match=r"zero_optimization.offload_everything = True"):
        cfg = from_deepspeed({**base, "zero_optimization": {"stage": 2, "offload_everything": True}},
                             data_parallel_size=2)
    assert cfg.zero_stage == 2


def test_auto_is_explained_where_it_breaks_the_batch():
    with pytest.raises(ValueError, match=r'(?s)train_batch_size 8 !=.*"auto" in train_micro_batch_size_per_gpu: a '
                                         r"Hugging Face Trainer placeholder, read as unset; give a number"):
        from_deepspeed({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                        "gradient_accumulation_steps": 3}, data_parallel_size=2)


@pytest.mark.parametrize("content,message", [
    (b"", r"is empty"), (b'{"a": 1,}', r"is not valid JSON"), (b"\xff\xfe\x00", r"not UTF-8 text"),
    (b"[1]", r"expected a JSON object at the top level, got list")])
def test_bad_config_files_are_named(tmp_path, content, message):
    p = tmp_path / "cfg.json"
    p.write_bytes(content)
    for read in (from_deepspeed, load_config):
        with pytest.raises(ValueError, match=rf"config {re.escape(str(p))}:? .*{message}|config {re.escape(str(p))}: {message}"):
            read(p)
    t = tmp_path / "cfg.toml"
    t.write_bytes(b"steps = = 3")
    with pytest.raises(ValueError, match=rf"config {re.escape(str(t))} is not valid TOML"):
        load_config(t)
