"""train_step with a pipelined loss: the GPT cut into stages over the mesh's ``pipe`` axis
trains as the single-device GPT does (losses and parameters over 10 steps), for every
schedule, on the virtual mesh and on gloo ranks, alone and with data parallelism and
ZeRO-1/2 on the data axis."""

from __future__ import annotations

import json
import os
import sys

import commands
import optree
import pipeline_cases as C
import pytest
import torch

import fsharded as fs
from fsharded.models import gpt, gpt_plans, gpt_stages
from fsharded.parallel import pipeline as pp
from fsharded.testing import run_on_ranks

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return C.train_reference(STEPS)


def assert_trains_like(out, ref):
    for a, b in zip(out["losses"], ref["losses"]):
        assert abs(a - b) < 1e-5, (out["losses"], ref["losses"])
    for path, a, b in zip(optree.tree_paths(out["params"]), optree.tree_leaves(out["params"]),
                          optree.tree_leaves(ref["params"])):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (path, float((a - b).abs().max()))


@pytest.mark.parametrize("mesh,name,v,zero", [
    ({"pipe": 2}, "gpipe", 1, 0), ({"pipe": 2}, "1f1b", 1, 0), ({"pipe": 2}, "interleaved", 2, 0),
    ({"pipe": 2}, "zb", 1, 0), ({"pipe": 4}, "1f1b", 1, 0), ({"pipe": 4}, "zb", 1, 0),
    ({"pipe": 2, "data": 2}, "1f1b", 1, 0), ({"data": 2, "pipe": 2}, "zb", 1, 1),
    ({"pipe": 2, "data": 2}, "interleaved", 2, 2)])
def test_on_the_virtual_mesh_it_trains_as_the_single_device_gpt(mesh, name, v, zero, reference):
    assert_trains_like(C.train(mesh, name, v, STEPS, zero=zero), reference)


@pytest.mark.parametrize("mesh,name,v,zero", [
    ({"pipe": 2}, "1f1b", 1, 0), ({"pipe": 2}, "zb", 1, 0), ({"pipe": 4}, "interleaved", 1, 0),
    ({"pipe": 2, "data": 2}, "zb", 1, 1), ({"data": 2, "pipe": 2}, "interleaved", 2, 2)])
def test_on_gloo_ranks_it_trains_as_the_single_device_gpt(mesh, name, v, zero, reference):
    if name == "interleaved" and v == 1:
        name = "gpipe"  # 4 stages on 4 ranks, one each
    world = 1
    for n in mesh.values():
        world *= n
    outs = run_on_ranks(C.train, world, mesh, name, v, STEPS, zero=zero)
    for out in outs:  # every rank has the same losses and, unsharded, the same parameters
        assert_trains_like(out, reference)


@pytest.mark.parametrize("ranks", [0, 4])
def test_pipe_by_tensor_trains_as_the_single_device_gpt(ranks, reference):
    # Megatron's plans inside each stage: the stage's psums over tensor, the activations
    # sent between pipe ranks typed as they were computed.
    if ranks:
        outs = run_on_ranks(C.train, ranks, {"pipe": 2, "tensor": 2}, "zb", 1, STEPS, tensor=True)
    else:
        outs = [C.train({"tensor": 2, "pipe": 2}, "1f1b", 1, STEPS, tensor=True)]
    for out in outs:
        assert_trains_like(out, reference)


def test_a_pipelined_loss_called_as_a_function_is_the_models_loss():
    params, tokens = C.setup()
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, 2, attention="einsum"), microbatches=4)
    ref = gpt.loss(params, {"tokens": tokens}, attention="einsum")
    assert abs(float(loss(params, {"tokens": tokens})) - float(ref)) < 1e-6


def _step(mesh, stages=2, **kw):
    params, tokens = C.setup()
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, stages, attention="einsum"), microbatches=2)
    step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=fs.Mesh(mesh), **kw)
    return step, params, {"tokens": tokens}


def test_what_the_pipeline_cannot_run_is_refused_with_the_fix():
    step, params, batch = _step({"data": 2})
    with pytest.raises(ValueError, match="axis 'pipe', which Mesh\\(data=2\\) does not have"):
        step(step.init(params), batch)
    step, params, batch = _step({"pipe": 2}, stages=3)
    with pytest.raises(ValueError, match="2 ranks .* = 2 stages, but the model was cut into 3"):
        step(step.init(params), batch)
    step, params, batch = _step({"pipe": 2}, accumulation=2)
    with pytest.raises(ValueError, match="micro-batches are the accumulation"):
        step(step.init(params), batch)
    step, params, _ = _step({"pipe": 2})
    with pytest.raises(ValueError, match="batch of 3 does not divide into 2 micro-batches"):
        step(step.init(params), {"tokens": torch.zeros(3, 17, dtype=torch.long)})


# -- fsharded train -------------------------------------------------------------------------

def _cli_argv(args, tmp_path, name, torchrun=0):
    from fsharded.testing import free_port
    head = [sys.executable, "-m", "fsharded", "train"]
    if torchrun:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun),
                "--master_port", str(free_port()), "-m", "fsharded", "train"]
    return [*head, "--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "5",
            "--set", "data=stdlib:300000", "--set", "model.n_layers=4", "--metrics", str(tmp_path / f"{name}.jsonl"),
            *args]


def _cli_all(runs, tmp_path):
    """{name: (stdout, losses)} of ``fsharded train`` runs given as name: (args, torchrun),
    two at a time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    results = commands.run_all([_cli_argv(a, tmp_path, n, t) for n, (a, t) in runs.items()], timeout=240, env=env)
    out = {}
    for name, r in zip(runs, results):
        assert r.returncode == 0, (name, r.stderr[-3000:])
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        out[name] = r.stdout, [json.loads(line)["loss"] for line in lines]
    return out


@pytest.mark.multiprocess
def test_fsharded_train_with_a_pipe_axis_trains_as_accumulation_does(tmp_path):
    # The same micro-batches, averaged: pipelined over pipe=2 as 1F1B and ZB, on the
    # virtual mesh and under torchrun, and accumulated without a pipeline.
    moe = ["--set", "model.moe.experts=4", "--set", "model.moe.top_k=2", "--set", "model.moe.bias_update_rate=0.05"]
    got = _cli_all({
        "base": (["--mesh", "data=1", "--set", "grad_accum_steps=4"], 0),
        "pipe": (["--mesh", "pipe=2", "--set", "pipeline.microbatches=4"], 0),
        "zb": (["--mesh", "pipe=2", "--set", "pipeline.schedule=zb", "--set", "pipeline.microbatches=4"], 0),
        "ranks": (["--mesh", "pipe=2", "--set", "pipeline.microbatches=4"], 2),
        "seq": (["--mesh", "pipe=2,seq=2", "--set", "pipeline.microbatches=4"], 0),
        # mixture of experts, with aux-loss-free routing biases (the model state) too
        "moe_base": (["--mesh", "expert=2", "--set", "grad_accum_steps=4", *moe], 0),
        "moe": (["--mesh", "pipe=2,expert=2", "--set", "pipeline.microbatches=4", *moe], 0),
    }, tmp_path)
    out = got["pipe"][0]
    assert "Mesh(pipe=2) on the virtual backend" in out and "pipeline 1f1b with 4 micro-batches" in out
    assert "on the distributed backend" in got["ranks"][0]
    assert "sequence over seq=2 (ulysses, contiguous)" in got["seq"][0]
    base = got["base"][1]
    for name in ("pipe", "zb", "ranks", "seq"):
        assert got[name][1] == pytest.approx(base, rel=1e-5, abs=1e-5), (name, got[name][1], base)
    assert got["moe"][1] == pytest.approx(got["moe_base"][1], rel=1e-5, abs=1e-5), (got["moe"][1], got["moe_base"][1])


def test_fsharded_train_counts_each_stages_micro_batches_held_in_its_memory_check(capsys, monkeypatch):
    from fsharded import train
    from fsharded.step import _estimate as _memory

    # 8 micro-batches of 16 rows: GPipe holds all 8 on each rank (~200 MiB on the virtual
    # mesh's 2 ranks, in this process), 1F1B 2 and 1 (~40 MiB); 100 MiB fits only 1F1B's.
    monkeypatch.setattr(_memory, "available_memory", lambda device="cpu": (100 * 2**20, "a test limit"))
    args = ["--preset", "tiny", "--steps", "1", "--mesh", "pipe=2", "--batch", "16", "--set", "pipeline.microbatches=8"]
    assert train.main([*args, "--set", "pipeline.schedule=gpipe"]) == 1
    err = capsys.readouterr().err
    assert "memory check: the training state and the pipeline's activations" in err, err[-1500:]
    assert "pipeline.schedule=1f1b holds at most pipe of them; now gpipe" in err
    assert train.main([*args, "--set", "pipeline.schedule=1f1b"]) == 0


def test_estimate_memory_of_a_pipelined_loss_is_the_largest_ranks_bound_of_micro_batches():
    # Against the memory tracker's peak of live activations on each gloo rank (the
    # executor's run): at least it, and within 25% of it.
    from fsharded.parallel.zero import Placement
    from fsharded.precision import as_policy
    from fsharded.step._estimate import pipeline_activations
    for name, p, m in [("gpipe", 2, 4), ("1f1b", 4, 8), ("zb", 4, 8)]:
        params, tokens = C.setup(batch=2 * m)
        loss = pp.pipelined(gpt_stages.pipeline_stages(params, p, attention="einsum"), schedule=name, microbatches=m)
        pl = Placement.replicated(optree.tree_map(lambda _: fs.P(), params))
        est = pipeline_activations(loss, params, pl, fs.Mesh({"pipe": p}), as_policy("fp32"), {"tokens": tokens},
                                   fs.P())
        got = [r["activations"] for r in run_on_ranks(C.tracked_rank, p, name, p, m)]
        for e, g in zip(est, got):
            assert g <= e <= 1.25 * g, (name, est, got)
        whole = fs.estimate_memory(params, fs.P(), fs.optim.adamw(1e-3), mesh=fs.Mesh({"pipe": p}), loss=loss,
                                   batch={"tokens": tokens}, batch_spec=fs.P())
        assert whole.activations == max(est) and "pipelined over 'pipe'" in whole.notes[-1]
    # stages that return their own loss terms beside the activation (MoE blocks)
    from fsharded.models.gpt import MoEConfig
    moe = MoEConfig(experts=4, top_k=2, every=1, capacity_factor=None)
    params, tokens = C.setup(moe=moe, batch=8)
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, 2, attention="einsum", moe=moe), microbatches=4)
    pl = Placement.replicated(optree.tree_map(lambda _: fs.P(), params))
    est = pipeline_activations(loss, params, pl, fs.Mesh({"pipe": 2}), as_policy("fp32"), {"tokens": tokens}, fs.P())
    assert len(est) == 2 and all(e > 0 for e in est)


def test_fsharded_train_refuses_a_pipe_it_cannot_run(tmp_path):
    from fsharded.config import TrainConfig
    with pytest.raises(ValueError, match="pipeline.schedule: expected one of gpipe, 1f1b, interleaved, zb"):
        TrainConfig(pipeline={"schedule": "1f2b"})
    with pytest.raises(ValueError, match="pipeline.microbatches 4 != grad_accum_steps 2"):
        TrainConfig(pipeline={"microbatches": 4}, grad_accum_steps=2)
    with pytest.raises(ValueError, match="virtual_stages: 2 stages per rank need schedule=interleaved"):
        TrainConfig(pipeline={"virtual_stages": 2})
    from fsharded.tools import train
    cfg = TrainConfig(mesh={"pipe": 4}, model={"preset": "tiny", "vocab_size": 256}, steps=1,
                      data="stdlib:300000", pipeline={"microbatches": 4})
    with pytest.raises(ValueError, match="pipe=4 x 1 stages per rank = 4 stages, but the model has 2 blocks"):
        train.run(cfg, progress="off")


def test_a_pipelined_runs_checkpoint_loads_into_other_layouts_and_back(tmp_path, reference):
    # 3 steps pipelined (pipe x data, ZeRO-1, on gloo ranks, each pipe rank writing its own
    # stages' leaves), 3 more without a pipeline (data=2, ZeRO-2, virtual): the straight run.
    # Then 2 on gloo ranks again (each loads its own stages' leaves, saves them in the
    # background) and 2 on the virtual mesh from what they saved.
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    first = run_on_ranks(C.train_saving, 4, {"pipe": 2, "data": 2}, "1f1b", 3, a, zero=1)[0]
    second = C.train_saving({"data": 2}, "", 3, b, load=a, start=3, zero=2, pipelined_run=False)
    third = run_on_ranks(C.train_saving, 2, {"pipe": 2}, "zb", 2, c, load=b, start=6, in_background=True)[0]
    fourth = C.train_saving({"pipe": 2}, "gpipe", 2, d, load=c, start=8)
    assert first + second + third + fourth == pytest.approx(reference["losses"], abs=1e-5)


# -- Hugging Face models cut through fs.nn --------------------------------------------------------

@pytest.mark.parametrize("kind,mesh,name,ranks", [
    ("llama", {"pipe": 2}, "1f1b", 0), ("llama", {"pipe": 2, "data": 2}, "zb", 0),
    ("gpt2", {"pipe": 2}, "interleaved", 0), ("llama", {"pipe": 2}, "zb", 2)])
def test_a_hugging_face_model_cut_through_fs_nn_trains_as_it_does_uncut(kind, mesh, name, ranks):
    pytest.importorskip("transformers")
    v = 2 if name == "interleaved" else 1  # two stages per rank: 4 stages of the 4 layers
    ref = C.hf_train(kind, {"data": 1}, "", 4)
    if ranks:
        outs = run_on_ranks(C.hf_train, ranks, kind, mesh, name, 4, v=v)
    else:
        outs = [C.hf_train(kind, mesh, name, 4, v=v)]
    for out in outs:
        assert_trains_like(out, ref)


@pytest.mark.parametrize("mesh,name,ranks", [({"pipe": 2}, "1f1b", 0), ({"pipe": 2, "data": 2}, "zb", 0),
                                            ({"pipe": 2}, "interleaved", 0), ({"pipe": 2}, "zb", 2)])
def test_dropout_draws_the_keys_it_draws_without_pipelining(mesh, name, ranks):
    # GPT-2 with its three dropouts on: each stage draws from its micro-batch's key
    # stream where the stages before it stopped, so every mask is the one accumulation
    # over the same micro-batches draws, whatever order the schedule runs the stages in.
    pytest.importorskip("transformers")
    v = 2 if name == "interleaved" else 1
    uncut = {"data": mesh.get("data", 1)}  # (each data shard draws from a key of its own)
    ref = C.hf_train("gpt2", uncut, "", 4, dropout=0.1)
    off = C.hf_train("gpt2", uncut, "", 4)
    assert abs(ref["losses"][0] - off["losses"][0]) > 1e-3  # the dropouts did draw
    if ranks:
        outs = run_on_ranks(C.hf_train, ranks, "gpt2", mesh, name, 4, v=v, dropout=0.1)
    else:
        outs = [C.hf_train("gpt2", mesh, name, 4, v=v, dropout=0.1)]
    for out in outs:
        assert_trains_like(out, ref)


@pytest.mark.parametrize("name,ranks", [("1f1b", 0), ("gpipe", 0), ("zb", 2)])
def test_stages_of_ones_own_draw_where_the_stage_before_stopped(name, ranks):
    # Plain Stages run only their own part: the count of keys drawn so far travels with
    # the activation (in the header on gloo ranks), and the next stage draws from there.
    ref = C.dropout_stages_train({"data": 1}, "", 4)
    if ranks:
        outs = run_on_ranks(C.dropout_stages_train, ranks, {"pipe": ranks}, name, 4)
    else:
        outs = [C.dropout_stages_train({"pipe": 2}, name, 4)]
    for out in outs:
        assert_trains_like(out, ref)


def test_a_ranks_memory_check_counts_its_own_stages():
    # On real ranks the first step's dry run (run for the collectives and the memory check)
    # runs every pipe rank's actions; what the other ranks allocate is not this rank's.
    for out in run_on_ranks(C.dry_peaks, 2):
        assert out["mine"] < 0.7 * out["every"], out


def test_what_each_end_of_a_cut_module_holds():
    pytest.importorskip("transformers")
    import model_zoo
    fm = fs.nn.functional(model_zoo.hf_llama(num_hidden_layers=4))
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    st = fs.nn.pipeline_stages(fm, 2, C.hf_loss, batch)
    assert (st.first_keys, st.last_keys, st.ranges) == (
        ("model.embed_tokens.weight",), ("lm_head.weight", "model.norm.weight"), (range(0, 2), range(2, 4)))
    fm = fs.nn.functional(model_zoo.hf_gpt2(n_layer=4))  # lm_head tied to wte: on both ends
    st = fs.nn.pipeline_stages(fm, 2, C.hf_loss, batch)
    assert "transformer.wte.weight" in st.first_keys and "transformer.wte.weight" in st.last_keys
    with pytest.raises(ValueError, match="no block list"):
        fs.nn.pipeline_stages(fs.nn.functional(torch.nn.Linear(2, 2)), 2, C.hf_loss, batch)


def test_a_deepspeed_configs_pipeline_block_maps_onto_the_pipe_axis():
    from fsharded.config import from_deepspeed
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "pipeline": {"stages": 2, "partition": "parameters", "seed_layers": False, "pipe_partitioned": True}}
    cfg = from_deepspeed(ds)
    # DeepSpeed's engine: 1F1B, gradient_accumulation_steps micro-batches, pipe the outer axis
    assert cfg.mesh == {"pipe": 2, "data": 2} and cfg.pipeline.schedule == "1f1b"
    assert (cfg.micro_batch_size, cfg.grad_accum_steps, cfg.train_batch_size) == (2, 8, 32)
    with pytest.raises(ValueError, match="pipeline.partition = 'uniform'"):
        from_deepspeed({**ds, "pipeline": {"stages": 2, "partition": "uniform"}})
    with pytest.raises(ValueError, match="pipeline.activation_checkpoint_interval"):
        from_deepspeed({**ds, "pipeline": {"stages": 2, "activation_checkpoint_interval": 1}})
    with pytest.raises(ValueError, match="pipeline.stages: 2, but the mesh's 'pipe' axis is 4"):
        from_deepspeed(ds, mesh={"pipe": 4})


@pytest.mark.parametrize("seq_parallel,mesh,name,ranks", [
    ("ulysses", {"pipe": 2, "seq": 2}, "1f1b", 0), ("ring", {"seq": 2, "pipe": 2}, "zb", 0),
    ("megatron", {"pipe": 2, "tensor": 2}, "gpipe", 0), ("ulysses", {"pipe": 2, "seq": 2}, "zb", 4),
    ("ring", {"seq": 2, "pipe": 2}, "1f1b", 4), ("megatron", {"pipe": 2, "tensor": 2}, "1f1b", 4)])
def test_pipe_by_sequence_parallelism_trains_as_the_single_device_gpt(seq_parallel, mesh, name, ranks):
    # Each stage's attention exchanges over the seq axis (Ulysses' all-to-alls, the ring's
    # sends; Megatron-SP over tensor) among the ranks holding that stage.
    ref = C.train_seq(None, "", 4)
    if ranks:
        outs = run_on_ranks(C.train_seq, ranks, mesh, name, 4, seq_parallel)
    else:
        outs = [C.train_seq(mesh, name, 4, seq_parallel)]
    for out in outs:
        assert_trains_like(out, ref)


@pytest.mark.parametrize("mesh,name,v,ranks", [({"pipe": 2}, "interleaved", 2, 0), ({"pipe": 2}, "zb", 1, 2),
                                              ({"pipe": 2, "expert": 2}, "1f1b", 1, 0),
                                              ({"pipe": 2, "expert": 2}, "zb", 1, 4)])
def test_a_mixture_of_experts_gpt_trains_as_it_does_uncut(mesh, name, v, ranks):
    # Each stage adds its MoE blocks' balancing and z-losses to the loss where they run
    # (its own backward seeds them); the experts' all-to-alls run over the expert axis
    # among the ranks holding the stage. The uncut run: the same mesh without pipe.
    ref = C.train_moe({a: n for a, n in mesh.items() if a != "pipe"}, "", 4)
    if ranks:
        outs = run_on_ranks(C.train_moe, ranks, mesh, name, 4, v=v)
    else:
        outs = [C.train_moe(mesh, name, 4, v=v)]
    for out in outs:
        assert_trains_like(out, ref)
        # and reports gpt.loss(metrics=True)'s metrics: every stage's MoE blocks', summed over the pipe
        for got, want in zip(out["metrics"], ref["metrics"]):
            assert set(got) == set(want) == {"lm_loss", "moe_aux_loss", "moe_z_loss", "moe_drop_fraction",
                                             "moe_load_imbalance"}
            for k in want:
                assert abs(got[k] - want[k]) < 1e-5, (k, got, want)



@pytest.mark.parametrize("mesh,name,v,ranks", [({"pipe": 2}, "interleaved", 2, 0), ({"pipe": 2}, "zb", 1, 2),
                                              ({"pipe": 2, "expert": 2}, "1f1b", 1, 4)])
def test_aux_loss_free_routing_biases_move_as_they_do_uncut(mesh, name, v, ranks):
    # The model state: each stage's MoE blocks read their routing biases and report their
    # loads per expert; summed over the pipe, the loads move every bias as without a pipeline.
    ref = C.train_moe({a: n for a, n in mesh.items() if a != "pipe"}, "", 4, biased=True)
    assert any(float(b.abs().max()) > 0 for b in ref["biases"])  # they did move
    if ranks:
        outs = run_on_ranks(C.train_moe, ranks, mesh, name, 4, v=v, biased=True)
    else:
        outs = [C.train_moe(mesh, name, 4, v=v, biased=True)]
    for out in outs:
        assert_trains_like(out, ref)
        assert len(out["biases"]) == len(ref["biases"])
        for a, b in zip(out["biases"], ref["biases"]):
            assert torch.allclose(a, b, atol=1e-6), (a, b)


def test_a_stages_loss_that_varies_over_a_non_batch_axis_is_refused_as_train_step_refuses_it():
    # Experts split over 'expert' with the rows not split over it: each shard's loss is a
    # partial piece of a different model, with a pipeline as without.
    from fsharded.models.gpt import MoEConfig
    moe = MoEConfig(experts=4, top_k=2, every=1, capacity_factor=None)
    params, tokens = C.setup(moe=moe)
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, 2, attention="einsum", moe=moe), microbatches=2)
    step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"pipe": 2, "expert": 2}),
                         param_specs=gpt_plans.expert_parallel_specs(params), batch_spec=fs.P())
    with pytest.raises(ValueError, match="the loss varies over mesh axis 'expert'"):
        step(step.init(params), {"tokens": tokens})


@pytest.mark.parametrize("ranks", [0, 8])
def test_pipe_by_zero3_data_by_tensor_trains_as_the_single_device_gpt(ranks, reference):
    # Megatron's plans inside each stage, every leaf's tensor shard sharded again over data
    # for storage (ZeRO-3) and gathered once for the step.
    mesh = {"pipe": 2, "data": 2, "tensor": 2}
    if ranks:
        outs = run_on_ranks(C.train, ranks, mesh, "zb", 1, STEPS, zero=3, tensor=True)
    else:
        outs = [C.train(mesh, "1f1b", 1, STEPS, zero=3, tensor=True),
                C.train({"tensor": 2, "pipe": 2, "data": 2}, "interleaved", 2, STEPS, zero=3, tensor=True)]
    for out in outs:
        assert_trains_like(out, reference)


@pytest.mark.parametrize("ranks", [0, 4])
def test_pipe_by_zero3_data_trains_as_the_single_device_gpt(ranks, reference):
    # What DeepSpeed's pipeline engine refuses: each rank's stages' weights sharded over
    # data, gathered once for the step, their gradients reduce-scattered back.
    mesh = {"pipe": 2, "data": 2}
    if ranks:
        outs = run_on_ranks(C.train, ranks, mesh, "1f1b", 1, STEPS, zero=3)
    else:
        outs = [C.train(mesh, "zb", 1, STEPS, zero=3), C.train(mesh, "interleaved", 2, STEPS, zero=3)]
    for out in outs:
        assert_trains_like(out, reference)


@pytest.mark.parametrize("ranks", [0, 4])
def test_pipe_by_zero3_regathered_per_microbatch_trains_as_the_single_device_gpt(ranks, reference):
    # reshard_after_forward=True under a pipeline: each block's weights gathered at its
    # run_block for every micro-batch, freed after its forward, gathered again in its
    # backward (saved-tensor hooks on gloo ranks, a remat on the virtual mesh), their
    # gradients reduce-scattered there; the embeddings and head still at the table's actions.
    mesh = {"pipe": 2, "data": 2}
    if ranks:
        outs = run_on_ranks(C.train, ranks, mesh, "zb", 1, STEPS, zero=3, reshard=True)
    else:
        outs = [C.train(mesh, "1f1b", 1, STEPS, zero=3, reshard=True),
                C.train(mesh, "interleaved", 2, STEPS, zero=3, reshard=True),
                C.train({**mesh, "tensor": 2}, "1f1b", 1, STEPS, zero=3, tensor=True, reshard=True)]
    for out in outs:
        assert_trains_like(out, reference)


def test_pipe_by_zero3_regathered_per_microbatch_holds_about_two_blocks_whole():
    # On 2 x 2 gloo ranks, 8 blocks (4 per stage), 4 micro-batches: by default a stage's
    # weights are whole from its first action to its last; regathered, about two blocks'
    # (one computing, one gathered again in backward) besides the embeddings. The manifest
    # lists what runs: per block and micro-batch a gather in forward, one in backward and
    # a reduce-scatter; no other reduction over data than the update's norm and loss.
    per_stage, per_block = (run_on_ranks(C.zero3_weights_peak, 4, r) for r in (None, True))
    params, _ = C.setup(layers=8, **C.TRAIN_CFG)
    block = sum(t.numel() * t.element_size() for t in optree.tree_leaves(params["blocks"][0]))
    outside = sum(t.numel() * t.element_size() for k in ("emb", "pos") for t in optree.tree_leaves(params[k]))
    for a, b in zip(per_stage, per_block):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["stored"] == b["stored"]
        whole, regathered = a["peak"] - a["stored"], b["peak"] - b["stored"]
        assert whole >= 4 * block, (whole, block)  # the stage's 4 blocks at once
        assert regathered <= 2 * block + outside, (regathered, block, outside)
        assert [a["ops"].count(op) for op in (("all_gather", "data"), ("psum_scatter", "data"), ("psum", "data"))] \
            == [1, 1, 2], a["ops"]
        assert [b["ops"].count(op) for op in (("all_gather", "data"), ("psum_scatter", "data"), ("psum", "data"))] \
            == [1 + 2 * 4 * 4, 1 + 4 * 4, 2], b["ops"]


def test_the_memory_estimate_counts_a_stage_or_two_blocks_whole_as_pipe_by_zero3_gathers_them():
    # By default a pipelined ZeRO-3 step holds its stage's weights whole for the step; with
    # reshard_after_forward=True about two blocks and the stage's other leaves.
    params, tokens = C.setup(layers=8, batch=16, **C.TRAIN_CFG)
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, 2, attention="einsum"), microbatches=4)
    mesh = fs.Mesh({"pipe": 2, "data": 2})
    block = sum(t.numel() * t.element_size() for t in optree.tree_leaves(params["blocks"][0]))
    est = {r: fs.estimate_memory(params, fs.parallel.zero(3, min_size=8, reshard_after_forward=r)(None, params),
                                 fs.optim.adamw(1e-2), mesh=mesh, loss=loss, batch={"tokens": tokens})
           for r in (None, True)}
    assert est[None].params >= 4 * block, (est[None].params, block)
    assert est[True].params + est[True].compute_params <= 2 * block + 8192, (est[True], block)


@pytest.mark.parametrize("ranks", [0, 4])
def test_zero3_gathers_and_releases_each_chunk_at_its_table_actions(ranks, reference):
    # Interleaved under ZeRO-3: each chunk's weights gathered at its GATHER action (on gloo
    # ranks issued one compute action ahead and waited for at the chunk's first use) and
    # reduce-scattered at its RELEASE, each chunk once per step.
    mesh = {"pipe": 2, "data": 2}
    if ranks:
        outs = run_on_ranks(C.train, ranks, mesh, "interleaved", 2, STEPS, zero=3, m=4, batch=16)
    else:
        outs = [C.train(mesh, "interleaved", 2, STEPS, zero=3, m=4, batch=16, manifest=True)]
        table = pp.pipelined(gpt_stages.pipeline_stages(C.setup(**C.TRAIN_CFG)[0], 4), schedule="interleaved",
                             microbatches=4, virtual=2).gathers_table(2)
        kinds = [a.kind for row in table.actions for a in row]
        assert kinds.count("GATHER") == kinds.count("RELEASE") == 4  # 2 ranks x 2 chunks
        ops = outs[0]["manifest"]
        # one bucketed all-gather per GATHER, one reduce-scatter per RELEASE, over data
        assert ops.count(("all_gather", "data")) == kinds.count("GATHER")
        assert ops.count(("psum_scatter", "data")) == kinds.count("RELEASE")
    for out in outs:
        assert_trains_like(out, C.train_reference(STEPS, batch=16))


def test_the_tied_embedding_is_summed_among_its_holders_alone():
    # pipe=4: the first and the last rank hold the tied embedding and sum its two
    # gradient parts between them (a group of two); the ranks between send nothing for it.
    steps = 3
    outs = run_on_ranks(C.train_stored, 4, {"pipe": 4}, "1f1b", steps, observe=True)
    params, _ = C.setup(**C.TRAIN_CFG)
    emb = params["emb"].numel()
    for rank, out in enumerate(outs):
        sums = [(k, n) for k, n in out["all_reduces"] if k == emb]
        if rank in (0, 3):
            assert sums == [(emb, 2)] * steps, (rank, out["all_reduces"])
        else:
            assert not sums, (rank, out["all_reduces"])
    ref = C.train_reference(steps)
    for out in outs:
        assert_trains_like(out, ref)


# -- precision and frozen leaves ---------------------------------------------------------------

def _same_run(got, ref, tol, atol=1e-5):
    assert got["skipped"] == ref["skipped"] and got["scales"] == ref["scales"]
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= tol, (got["losses"], ref["losses"])
    for path, a, b in zip(optree.tree_paths(got["params"]), optree.tree_leaves(got["params"]),
                          optree.tree_leaves(ref["params"])):
        assert torch.allclose(a, b, atol=atol, rtol=1e-4), (path, float((a - b).abs().max()))


@pytest.mark.parametrize("ranks", [0, 2])
def test_fp16_takes_one_loss_scale_across_the_stages_and_skips_overflows_as_accumulation_does(ranks):
    # 2**21 overflows fp16's backward at first: both runs skip the same steps and move the
    # scale the same way (each micro-batch's loss over m before its backward, as
    # DeepSpeed's engine does), and train alike in between. Untied embeddings: a tied one
    # is cast once per stage here, so its two halves add up in fp32, not in fp16.
    kw = dict(power=21, tied_embeddings=False)
    ref = C.train_mixed(None, "1f1b", 8, "fp16", **kw)
    assert 0 < ref["skipped"][-1] < 8 and len(set(ref["scales"])) > 1  # both kinds of step happened
    if ranks:
        outs = run_on_ranks(C.train_mixed, ranks, {"pipe": 2}, "1f1b", 8, "fp16", **kw)
    else:
        outs = [C.train_mixed({"pipe": 2}, name, 8, "fp16", **kw) for name in ("1f1b", "zb")]
    for out in outs:  # (on gloo ranks the matmuls sum in another order: fp16's rounding, through Adam)
        _same_run(out, ref, tol=2e-5, atol=5e-4 if ranks else 1e-5)


def test_bf16_stages_compute_in_bf16_and_add_their_gradients_in_fp32():
    ref = C.train_mixed(None, "1f1b", 6, "bf16", m=4, tied_embeddings=False)
    fp32 = C.train_mixed(None, "1f1b", 6, "fp32", m=4, tied_embeddings=False)
    assert max(abs(a - b) for a, b in zip(ref["losses"], fp32["losses"])) > 1e-4  # bf16 did round
    _same_run(C.train_mixed({"pipe": 2}, "interleaved", 6, "bf16", m=4, v=2, tied_embeddings=False), ref,
              tol=1e-6)


def _frozen(path, _):
    return not (path.startswith("blocks.0.") or path.startswith("final_norm.") or path == "pos")


def _first_stage_frozen(path, _):  # every leaf of the first stage (tied: the head too)
    return not (path.startswith(("blocks.0.", "blocks.1.")) or path in ("pos", "emb"))


@pytest.mark.parametrize("ranks,frozen,zero", [(0, _frozen, 0), (2, _frozen, 0), (0, _first_stage_frozen, 0),
                                               (2, _first_stage_frozen, 0), (0, _frozen, 3), (4, _frozen, 3)])
def test_frozen_leaves_stay_as_they_are_and_the_rest_trains_as_without_pipelining(ranks, frozen, zero):
    # frozen: a block of the first stage, the final norm on the last, the positions; or
    # the whole first stage (nothing of it to differentiate). Under ZeRO-3 the frozen
    # shards are gathered with their stage and get no gradient back.
    ref = C.train_mixed(None, "1f1b", 6, "fp32", trainable=frozen)
    init, _ = C.setup(**C.TRAIN_CFG)
    if ranks:
        mesh = {"pipe": 2, "data": 2} if zero else {"pipe": 2}
        outs = run_on_ranks(C.train_mixed, ranks, mesh, "zb", 6, "fp32", trainable=frozen, zero=zero)
    else:
        outs = [C.train_mixed({"pipe": 2, "data": 2}, "1f1b", 6, "fp32", trainable=frozen, zero=zero)]
    for out in outs:
        for path, a, b, x in zip(optree.tree_paths(out["params"]), optree.tree_leaves(out["params"]),
                                 optree.tree_leaves(ref["params"]), optree.tree_leaves(init)):
            dotted = ".".join(map(str, path))
            if not frozen(dotted, None):
                assert torch.equal(a, x), dotted
            else:
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), dotted
                assert not torch.equal(a, x), dotted
        for a, b in zip(out["losses"], ref["losses"]):
            assert abs(a - b) < 1e-5


# -- per-stage storage ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clipped_reference():
    return C.train_reference(6, clip=0.5)


@pytest.mark.parametrize("mesh,name,v,zero", [
    ({"pipe": 2}, "1f1b", 1, 0), ({"pipe": 4}, "gpipe", 1, 0), ({"pipe": 2}, "interleaved", 2, 0),
    ({"pipe": 2, "data": 2}, "zb", 1, 1), ({"pipe": 2, "data": 2}, "1f1b", 1, 3)])
def test_each_pipe_rank_stores_its_own_stages_state_and_trains_as_the_single_device_gpt(
        mesh, name, v, zero, clipped_reference):
    # Clipped: the global norm adds every pipe rank's part once (the tied embedding's two
    # copies counted once); the losses, norms and parameters are the single device's.
    world = 1
    for n in mesh.values():
        world *= n
    outs = run_on_ranks(C.train_stored, world, mesh, name, 6, zero=zero, v=v, clip=0.5)
    params, _ = C.setup(**C.TRAIN_CFG)
    paths, leaves, _ = fs.mesh._tree.tree_flatten_with_paths(params)
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, mesh["pipe"] * v), schedule=name, microbatches=2,
                        virtual=v)
    owners = loss.owners(paths, mesh["pipe"])
    full = sum(x.numel() * x.element_size() for x in leaves)
    for rank, out in enumerate(outs):
        me = fs.Mesh(mesh).coords(rank)["pipe"]
        held = [p for p, o in zip(paths, owners) if me in o]
        assert sorted(out["held"]) == sorted(held)
        last = mesh["pipe"] - 1  # the tied embedding on both ends
        assert ("emb" in held) == (me in (0, last)) and ("pos" in held) == (me == 0)
        assert ("final_norm.w" in held) == (me == last)
        mine = sum(x.numel() * x.element_size() for x, o in zip(leaves, owners) if me in o)
        if "data" not in mesh:  # exactly its leaves, and one element per placeholder
            assert out["param_bytes"] == mine + 4 * (len(paths) - len(held))
        else:  # its leaves, sharded over data (the smallest kept whole)
            assert mine / 2 <= out["param_bytes"] <= mine * 0.6
        assert out["param_bytes"] < full * (0.75 if mesh["pipe"] == 2 else 0.5)
        # Adam's two moments of the same leaves (and its step counter)
        assert 2 * out["param_bytes"] - 64 <= out["opt_bytes"] <= 2 * out["param_bytes"] + 64
        assert out["losses"] == pytest.approx(clipped_reference["losses"], abs=1e-5)
        assert out["norms"] == pytest.approx(clipped_reference["norms"], rel=1e-5)
        assert_trains_like(out, clipped_reference)


def test_estimate_memory_counts_the_state_of_the_rank_that_stores_most():
    params, _ = C.setup(**C.TRAIN_CFG)
    paths, leaves, _ = fs.mesh._tree.tree_flatten_with_paths(params)
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, 2), schedule="1f1b", microbatches=2)
    owners = loss.owners(paths, 2)
    per_rank = [sum(x.numel() * 4 for x, o in zip(leaves, owners) if r in o) for r in range(2)]
    est = fs.estimate_memory(params, None, fs.optim.adamw(1e-2), mesh=fs.Mesh({"pipe": 2}), loss=loss,
                                    activation_bytes=0)
    whole = fs.estimate_memory(params, None, fs.optim.adamw(1e-2), mesh=fs.Mesh({"pipe": 2}),
                                      activation_bytes=0)
    assert est.master == max(per_rank) < whole.master == sum(x.numel() * 4 for x in leaves)
    assert 2 * max(per_rank) <= est.optimizer <= 2 * max(per_rank) + 64  # (and its counters)
    assert any("rank" in n and "stores its stages' state" in n for n in est.notes)


def test_fp16_keeps_the_placeholders_of_the_leaves_a_rank_does_not_hold():
    # the overflow's select passes the leaves a rank does not hold through as they are
    outs = run_on_ranks(C.train_mixed, 2, {"pipe": 2}, "1f1b", 3, "fp16", power=21, tied_embeddings=False,
                        stored=True)
    for out in outs:
        assert out["skipped"][-1] > 0
        assert out["param_bytes"] < 0.75 * out["full_bytes"] and out["opt_bytes"] < 1.5 * out["full_bytes"]


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_nan_gradient_in_one_stage_is_named_or_skipped_on_every_pipe_rank(on_nonfinite):
    # The NaN weight of the second stage makes every gradient NaN (backward runs through its
    # NaN activations): every rank names the same leaves, each stage's among them, or skips.
    outs = run_on_ranks(C.nonfinite_stage, 2, {"pipe": 2}, on_nonfinite)
    n = len(optree.tree_leaves(C.setup(**C.TRAIN_CFG)[0]))
    for out in outs:
        if on_nonfinite == "skip":
            assert out == "skipped 1"
        else:
            named = out.split("It was not applied")[0]
            assert named == outs[0].split("It was not applied")[0]
            assert "non-finite gradients in params.blocks.0." in named and f"and {n - 5} more" in named, out
    if on_nonfinite == "raise":  # the rank that holds the NaN weight says so
        assert "non-finite values on rank 1 in params.blocks.2.mlp.w_in" in outs[1]
        assert "non-finite values" not in outs[0]


def test_a_state_of_placeholders_is_not_saved_without_its_owners(tmp_path):
    for out in run_on_ranks(C.saved_elsewhere, 2, str(tmp_path / "ck")):
        save, dcp = out.split("\n", 1)
        assert "placeholders" in save and "step.save" in save
        assert "placeholders" in dcp and "step.params" in dcp


def test_the_schedule_check_compares_the_collectives_of_each_group_of_ranks():
    from fsharded.spmd._schedule import _group_differences
    mesh = fs.Mesh({"pipe": 2, "data": 2})  # ranks 0, 1 at pipe 0; 2, 3 at pipe 1
    d = [("backward", "psum", "data", "float32", (8,))]
    p = [("update", "psum", "pipe", "float32", ())]
    other = [("backward", "psum", "data", "float32", (6,))]
    # each pipe coordinate reduces its own leaves over data: fine
    assert _group_differences([d + p, d + p, other + p, other + p], mesh) == []
    # one rank of a data group runs a collective its peer does not, either way round
    for lists in ([d + p, d + d + p, other + p, other + p], [d + d + p, d + p, other + p, other + p]):
        lines = _group_differences(lists, mesh)
        assert lines and "over data" in lines[0] and "rank 0" in lines[0] and "rank 1" in lines[0]
    # ranks of one pipe group that disagree over pipe
    lines = _group_differences([d + p, d + p, other, other + p], mesh)
    assert any("over pipe" in x and "rank 0" in x and "rank 2" in x for x in lines)
