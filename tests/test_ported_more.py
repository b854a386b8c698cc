"""Code ported from JAX, Hugging Face and DeepSpeed, tried as its users write it: numpy
arrays as shard_map arguments, checkpoints of empty trees and of odd keys, Hugging Face
Trainer's "auto" in a DeepSpeed scheduler block, a ZeRO plan given where specs are
expected."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.config import ConfigWarning, from_deepspeed

# -- shard_map: numpy arrays as arguments, as jax.shard_map takes them -----------------------


def numpy_arguments(n: int) -> dict:
    """A numpy array split by its spec (jax.shard_map takes one as an array), next to a
    replicated one and a numpy scalar (left as it is, like a Python number)."""
    mesh = fs.Mesh({"i": n})
    x = np.arange(4.0 * n).reshape(2 * n, 2)  # float64: the dtype is kept
    out = {"sum": fs.shard_map(lambda x: fs.psum(x.sum(0), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x)}
    out["matmul"] = fs.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))(
        x.astype(np.float32), np.ones((2, 3), np.float32))
    out["scaled"] = fs.shard_map(lambda x, k: x * k, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))(
        np.arange(2 * n), np.int64(3))
    return out


def _check_numpy_arguments(got: dict, n: int) -> None:
    x = torch.arange(4.0 * n, dtype=torch.float64).reshape(2 * n, 2)
    torch.testing.assert_close(got["sum"], x.sum(0), rtol=0, atol=0)  # integers in float64: exact
    torch.testing.assert_close(got["matmul"], x.float() @ torch.ones(2, 3), rtol=0, atol=0)
    assert got["scaled"].dtype == torch.int64 and got["scaled"].tolist() == [3 * i for i in range(2 * n)]


def test_numpy_arrays_are_split_by_their_specs_on_the_virtual_mesh():
    _check_numpy_arguments(numpy_arguments(2), 2)


@pytest.mark.multiprocess
def test_numpy_arrays_are_split_by_their_specs_on_gloo_ranks():
    from fsharded.testing import run_on_ranks

    for got in run_on_ranks(numpy_arguments, 2, 2):
        _check_numpy_arguments(got, 2)


# -- checkpoints: empty trees, a key "" ------------------------------------------------------


@pytest.mark.parametrize("tree", [{}, [], (), {"a": {}, "b": []}], ids=["dict", "list", "tuple", "nested"])
def test_an_empty_tree_loads_back_without_a_template(tmp_path, tree):
    mesh = fs.Mesh({"data": 2})
    fs.checkpoint.save(tmp_path / "ck", tree, P(), mesh)
    assert fs.checkpoint.tree_like(tmp_path / "ck") == tree
    got = fs.checkpoint.load(tmp_path / "ck", None, P(), mesh)
    assert type(got) is type(tree) and got == tree


def test_a_key_of_the_empty_string_is_not_mistaken_for_the_root(tmp_path):
    tree = {"": torch.arange(3.0), "w": torch.ones(2)}
    mesh = fs.Mesh({"data": 2})
    fs.checkpoint.save(tmp_path / "ck", tree, P(), mesh)
    got = fs.checkpoint.load(tmp_path / "ck", None, P(), mesh)
    assert list(got) == ["", "w"] and torch.equal(got[""], tree[""]) and torch.equal(got["w"], tree["w"])


# -- DeepSpeed: "auto" in the scheduler block --------------------------------------------------


def _hf_trainer(scheduler: dict) -> dict:
    return {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "scheduler": scheduler}


def test_auto_scheduler_params_are_unset_as_documented():
    """HF Trainer's "auto" counts as unset: WarmupLR warms up to the optimizer's lr (as an
    absent warmup_max_lr does) with DeepSpeed's defaults for the rest; it was a TrainConfig
    error "expected float, got None" that did not name "auto"."""
    ds = _hf_trainer({"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}})
    with pytest.warns(ConfigWarning, match="auto"):
        cfg = from_deepspeed(ds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        plain = from_deepspeed(_hf_trainer({"type": "WarmupLR"}))
    assert cfg.scheduler == plain.scheduler and cfg.scheduler.params == {"warmup_max_lr": 2e-3}


def test_an_auto_required_scheduler_param_is_named_as_required():
    ds = _hf_trainer({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": "auto"}})
    with pytest.raises(ValueError, match=r'(?s)total_num_steps: required by WarmupDecayLR.*"auto" in '
                                         r'scheduler\.params\.total_num_steps'):
        from_deepspeed(ds)


# -- a ZeRO plan where a spec tree is expected ---------------------------------------------------


def test_a_zero_plan_given_as_specs_is_named_briefly(tmp_path):
    params = {"w": torch.randn(64, 64)}
    plan = fs.parallel.zero(3, min_size=1)(P(), params)
    with pytest.raises(ValueError, match=r"plan\.resolve\(mesh\)\.params") as e:
        fs.checkpoint.save(tmp_path / "ck", params, plan, fs.Mesh({"data": 2}))
    assert len(str(e.value)) < 600  # not the parameters' values
    specs = plan.resolve(fs.Mesh({"data": 2})).params
    fs.checkpoint.save(tmp_path / "ck", params, specs, fs.Mesh({"data": 2}))


HF_TRAINER_ZERO3 = {  # Hugging Face's documented ZeRO-3 config, as users copy it
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_hf_trainers_config_with_auto_batch_sizes_reads_and_takes_the_batch_given():
    """All three batch sizes "auto": HF Trainer fills them from its arguments; here they
    are TrainConfig's default micro batch, or the one given (micro_batch_size=, fsharded
    train --batch). It was an error ("either train_batch_size or ... must be given")
    whatever --batch said."""
    with pytest.warns(ConfigWarning, match="auto"):
        cfg = from_deepspeed(HF_TRAINER_ZERO3, data_parallel_size=2)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps, cfg.zero_stage) == (2, 1, 1, 3)
    with pytest.warns(ConfigWarning):
        cfg = from_deepspeed(HF_TRAINER_ZERO3, data_parallel_size=2, micro_batch_size=4, grad_accum_steps=2)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps) == (16, 4, 2)
    # No batch size at all, "auto" or given, is still DeepSpeed's error.
    with pytest.raises(ValueError, match="either train_batch_size or train_micro_batch_size_per_gpu"):
        from_deepspeed({"optimizer": {"type": "AdamW"}})


def test_fsharded_train_reads_hf_trainers_config_with_its_batch_flag(tmp_path):
    import json

    from fsharded import train

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_TRAINER_ZERO3))
    args = train.build_parser().parse_args(["--preset", "tiny", "--batch", "4", "--accum", "2", "--steps", "3",
                                            "--mesh", "data=2", "--deepspeed-config", str(path)])
    with pytest.warns(ConfigWarning):
        cfg = train.make_config(args)
    assert (cfg.micro_batch_size, cfg.grad_accum_steps, cfg.train_batch_size, cfg.zero_stage) == (4, 2, 16, 3)
