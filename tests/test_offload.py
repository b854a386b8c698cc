"""Optimizer offload (``zero(stage, offload_optimizer="cpu" | "nvme")``): the same numbers
as in device memory, bit for bit, on the virtual mesh and on gloo ranks; the NVMe tier's
files, checksums, errors and checkpoints; its C++ file I/O."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import offload_cases as O
import optree
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.kernels import aio
from fsharded.models import gpt

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def in_memory():
    return {stage: O.run({"data": 2}, stage, None) for stage in (1, 2, 3)}


# -- the C++ file I/O ---------------------------------------------------------------------------


def test_aio_writes_and_reads_back_with_checksums(tmp_path):
    f = aio.File.create(tmp_path / "a.bin", 10_000)
    try:
        buf = aio.aligned_empty(10_000)
        assert buf.data_ptr() % aio.ALIGN == 0 and buf.numel() % aio.ALIGN == 0
        data = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        buf[:10_000] = data
        crc = f.write(0, buf, 10_000).wait()
        assert crc == aio.checksum(data)
        back = aio.aligned_empty(10_000)
        assert f.read(0, back, 10_000).wait() == crc
        assert torch.equal(back[:10_000], data)
        # The bytes changed behind the file's back read with another checksum.
        with open(tmp_path / "a.bin", "r+b") as raw:
            raw.seek(123)
            raw.write(bytes([data[123].item() ^ 0xFF]))
        assert f.read(0, back, 10_000).wait() != crc
        if f.direct:  # O_DIRECT wants aligned offsets and addresses: refused, not corrupted
            with pytest.raises(ValueError, match="multiples of 4096"):
                f.read(100, back, 100)
    finally:
        f.close()


def test_aio_refuses_a_truncated_file_a_short_read_and_a_full_disk(tmp_path):
    f = aio.File.create(tmp_path / "b.bin", 8192)
    f.close()
    with pytest.raises(RuntimeError, match="truncated"):
        aio.File.open(tmp_path / "b.bin", 1 << 20)
    f = aio.File.open(tmp_path / "b.bin", 8192)
    try:
        with pytest.raises(RuntimeError, match="short read"):
            f.read(8192, aio.aligned_empty(4096), 4096).wait()
    finally:
        f.close()
    free = shutil.disk_usage(tmp_path).free
    if free > 1 << 43:
        pytest.skip("a disk this large cannot be filled by one file")
    with pytest.raises(RuntimeError, match="the disk is full"):
        aio.File.create(tmp_path / "huge.bin", free + (1 << 30))
    assert not os.path.exists(tmp_path / "huge.bin")  # nothing half-made left behind


# -- the same numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_equals_device_memory_bit_for_bit_on_the_virtual_mesh(in_memory, stage, tier):
    got = O.run({"data": 2}, stage, tier)
    assert O.same(got, in_memory[stage])
    # The NVMe tier keeps every moment in a file; the host tier in memory.
    assert got["files"] == (got["moments"] if tier == "nvme" else 0)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offload_donated_equals_device_memory(in_memory, tier):
    got = O.run({"data": 2}, 2, tier, donate=True)
    assert O.same(got, in_memory[2])


def test_offload_equals_one_device_training():
    ref = T.run_train_step({"data": 1}, steps=O.STEPS)
    got = O.run({"data": 2}, 3, "nvme")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for a, b in zip(optree.tree_leaves(got["params"]), optree.tree_leaves(ref["params"])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_update_reads_gradients_streamed_to_the_host_where_they_are(monkeypatch):
    """Gradients copied to the host during backward (``offload.to_host``) are read by the
    streamed update in place: no gradient staging buffer, and the numbers of the copied path."""
    from fsharded.parallel import offload

    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    shapes = [(370, 5), (3000,), (3, 70, 11)]
    gen = torch.Generator().manual_seed(0)
    params0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    tier = offload.Offload(optimizer="cpu", bucket_elems=1024)
    made = []
    staging = offload._Staging

    def recorded(*a, **k):
        made.append(staging(*a, **k))
        return made[-1]

    monkeypatch.setattr(offload, "_Staging", recorded)
    out = {}
    for how in ("device", "host"):
        params = [p.clone().reshape(-1) for p in params0]
        state = opt.init([p.clone() for p in params0])
        step = fs.optim.FusedStep(opt, state)
        moments = [[m.view(-1) for m in ms] for ms in step.moment_leaves()]
        gs = [g.reshape(-1) for g in grads] if how == "device" else \
            [offload.to_host(g)[0].reshape(-1) for g in grads]
        assert [offload.on_host(g) for g in gs] == [how == "host"] * len(gs)
        made.clear()
        offload.stream_update(step, params, gs, moments, None, tier)
        assert made and all(st.g.numel() == (0 if how == "host" else st.p.numel()) for st in made)
        out[how] = params + [m for ms in moments for m in ms]
    assert all(torch.equal(a, b) for a, b in zip(out["device"], out["host"]))
    assert not torch.equal(out["host"][0], params0[0].reshape(-1))  # (it did update)


@pytest.mark.multiprocess
def test_offload_on_two_gloo_ranks_equals_device_memory_and_the_virtual_mesh(in_memory):
    from fsharded.testing import run_on_ranks

    per_rank = run_on_ranks(O.gloo_offload, 2, 2)
    for res in per_rank:
        for (stage, tier), r in res.items():
            assert r["same"], (stage, tier)
            assert r["files"] == (r["moments"] if tier == "nvme" else 0)
            # ZeRO 1 and 2 reduce in backward, each bucket then copied to the host (the update
            # runs there); ZeRO-1's all-reduced buckets at once, inside backward.
            if stage < 3:
                assert len(r["backward"]) == O.STEPS and all(h for h, _, _ in r["backward"]), r["backward"]
                if stage == 1:
                    assert all(s >= 1 for _, s, _ in r["backward"]), r["backward"]
            else:  # ZeRO-3's come back through the gathers' transposes, each copied to the host
                # once its reduce-scatter is done (those of the leaves gathered for the whole
                # step inside backward: their reduce-scatter is not left in flight)
                assert r["backward"] == [] and len(r["sinks"]) == O.STEPS, r["sinks"]
                assert all(s >= 1 and n > 0 and on_host for s, n, on_host in r["sinks"]), r["sinks"]
            # The update reads every gradient where backward put it on the host (no second copy).
            assert r["updates"] == [(n, n) for _, n in r["updates"]] and len(r["updates"]) == O.STEPS, r["updates"]
            # The two backends agree (to the float rounding of their reductions).
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(in_memory[stage]["losses"]),
                                       rtol=1e-5, atol=1e-5)
            for a, b in zip(optree.tree_leaves(r["params"]), optree.tree_leaves(in_memory[stage]["params"])):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# -- the NVMe tier's files ----------------------------------------------------------------------


def test_nvme_state_lives_in_files_under_the_path_and_leaves_with_the_process(tmp_path):
    step, params = O.make_step({"data": 2}, 2, "nvme", nvme_path=str(tmp_path))
    state = step.init(params)
    files = fs.parallel.offload.nvme_files(state.opt_state)
    assert len(files) == 2 * len(optree.tree_leaves(params))
    assert all(f.startswith(str(tmp_path)) and os.path.getsize(f) >= 4096 for f in files)
    assert "NVMe" in step.placement(params).describe()
    # The leaves are tensors: what a checkpoint or a user reads is the files' content, the
    # moments the step wrote (O_DIRECT) seen through the memory map.
    b = T.batches(1)[0]
    state, _ = step(state, b)
    host, _ = O.make_step({"data": 2}, 2, "cpu")
    ref, _ = host(host.init(params), b)
    moments = [x for x in optree.tree_leaves(state.opt_state) if isinstance(x, torch.Tensor) and x.dim() > 0]
    expect = [x for x in optree.tree_leaves(ref.opt_state) if isinstance(x, torch.Tensor) and x.dim() > 0]
    assert len(moments) == len(files) and all(bool((m != 0).any()) for m in moments)
    assert all(torch.equal(m, e) for m, e in zip(moments, expect))


def test_a_corrupted_state_file_is_an_error_naming_it(tmp_path):
    step, params = O.make_step({"data": 1}, 1, "nvme", nvme_path=str(tmp_path))
    state = step.init(params)
    b = T.batches(1)[0]
    state, _ = step(state, b)
    victim = sorted(fs.parallel.offload.nvme_files(state.opt_state))[3]
    with open(victim, "r+b") as raw:
        raw.seek(8)
        raw.write(b"\x7f\x7f\x7f\x7f")
    with pytest.raises(RuntimeError, match="does not hold what the step wrote") as e:
        step(state, b)
    assert victim in str(e.value) and "checkpoint" in str(e.value)


def test_nvme_state_checkpoints_and_resumes_into_any_tier(tmp_path):
    b = T.batches(6)
    ref_step, params = O.make_step({"data": 2}, 2, None)
    ref = ref_step.init(params)
    for x in b:
        ref, _ = ref_step(ref, x)
    step, _ = O.make_step({"data": 2}, 2, "nvme", nvme_path=str(tmp_path))
    state = step.init(params)
    for x in b[:3]:
        state, _ = step(state, x)
    step.save(state, tmp_path / "ckpt")
    for tier in ("nvme", "cpu", None):  # back into the NVMe tier, or the host, or device memory
        s2, _ = O.make_step({"data": 2}, 2, tier, nvme_path=str(tmp_path))
        got = s2.load(tmp_path / "ckpt")
        if tier == "nvme":
            assert len(fs.parallel.offload.nvme_files(got.opt_state)) == 2 * len(optree.tree_leaves(params))
        for x in b[3:]:
            got, _ = s2(got, x)
        for u, v in zip(optree.tree_leaves(s2.params(got)), optree.tree_leaves(ref_step.params(ref))):
            assert torch.equal(u, v), tier


@pytest.mark.multiprocess
def test_a_run_killed_mid_update_loses_nothing_after_resuming_from_its_checkpoint(tmp_path):
    ckpt, nvme = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    os.makedirs(nvme)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    code = (f"import offload_cases as O; O.train_then_die({ckpt!r}, {nvme!r}, save_at=3, die_at=5, "
            f"threads={torch.get_num_threads()})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]  # killed in its update, as arranged
    b = T.batches(8)
    ref_step, params = O.make_step({"data": 1}, 2, None)
    ref = ref_step.init(params)
    for x in b:
        ref, _ = ref_step(ref, x)
    step, _ = O.make_step({"data": 1}, 2, "nvme", nvme_path=nvme)
    state = step.load(ckpt)
    assert int(state.step) == 3
    for x in b[3:]:
        state, _ = step(state, x)
    for u, v in zip(optree.tree_leaves(step.params(state)), optree.tree_leaves(ref_step.params(ref))):
        assert torch.equal(u, v)


# -- bad input ----------------------------------------------------------------------------------


def test_offload_refuses_what_it_cannot_do(tmp_path):
    params = gpt.init(T.CONFIG, 0)
    with pytest.raises(ValueError, match="needs nvme_path"):
        fs.parallel.zero(2, offload_optimizer="nvme")
    with pytest.raises(ValueError, match="is not a directory"):
        fs.parallel.zero(2, offload_optimizer="nvme", nvme_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="must be None, 'cpu' or 'nvme'"):
        fs.parallel.zero(2, offload_optimizer="disk")
    with pytest.raises(ValueError, match="needs offload_optimizer= as well"):
        fs.parallel.zero(3, offload_params="cpu")
    with pytest.raises(ValueError, match="stage 0 does not shard them"):
        fs.parallel.zero(0, offload_optimizer="cpu", offload_params="cpu")
    # The NVMe tier streams a fused optimizer's moments: another optimizer is refused when
    # the state is made, not trained in memory behind the user's back (the host tier runs
    # it on host copies: tests/test_offload_host_optimizers.py).
    step, _ = O.make_step({"data": 2}, 2, "nvme", nvme_path=str(tmp_path), optimizer=fs.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(NotImplementedError, match="fused form"):
        step.init(params)
    # A state made by a step without offload is not in the tier: an error, not a silent
    # in-memory update.
    plain, _ = O.make_step({"data": 2}, 2, None)
    tiered, _ = O.make_step({"data": 2}, 2, "nvme", nvme_path=str(tmp_path))
    with pytest.raises(RuntimeError, match="not in"):
        tiered(plain.init(params), T.batches(1)[0])


# -- DeepSpeed's offload config, as fsharded train runs it --------------------------------------


def test_a_deepspeed_offload_config_trains_with_the_numbers_of_one_without(tmp_path, capsys):
    import json

    from fsharded.tools import train

    def run(offload):
        zero = {"stage": 2, **({"offload_optimizer": offload} if offload else {})}
        ds = tmp_path / f"ds-{bool(offload)}.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                                  "gradient_clipping": 1.0}))
        metrics = tmp_path / f"m-{bool(offload)}.jsonl"
        capsys.readouterr()
        code = train.main(["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000", "--steps", "4",
                           "--mesh", "data=2", "--deepspeed-config", str(ds), "--set", f"metrics_file={metrics}"])
        out, err = capsys.readouterr()
        assert code == 0, err
        return out, [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line]

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    plain_out, plain = run(None)
    out, got = run({"device": "nvme", "nvme_path": str(nvme), "pin_memory": True, "buffer_count": 4,
                    "fast_init": False})
    assert "optimizer state offloaded to nvme" in out
    assert len(plain) == 4 and got == plain
    out, got = run({"device": "cpu"})
    assert "optimizer state offloaded to cpu" in out and got == plain


def test_the_memory_estimate_knows_the_tiers(tmp_path):
    params = gpt.init(T.CONFIG, 0)
    opt = fs.optim.adamw(T.LR)
    mesh = fs.Mesh({"data": 2})
    est = {}
    for tier in (None, "cpu", "nvme"):
        kw = {} if tier is None else dict(offload_optimizer=tier, nvme_path=str(tmp_path), bucket_elems=2048)
        est[tier] = fs.estimate_memory(params, fs.parallel.zero(2, **kw)(P(), params), opt, mesh=mesh)
    # Two fp32 moments of each leaf's shard on a device (ZeRO-2 over data=2: large leaves halved).
    from fsharded.mesh._spec import shard_shape

    pl = fs.parallel.zero(2)(P(), params).resolve(mesh)
    specs = optree.tree_leaves(pl.master, is_leaf=lambda x: isinstance(x, fs.P))
    moments = sum(2 * 4 * math.prod(shard_shape(s, tuple(x.shape), mesh))
                  for s, x in zip(specs, optree.tree_leaves(params)))
    assert moments < 2 * 4 * sum(x.numel() for x in optree.tree_leaves(params))
    grads = est[None].grads  # ZeRO-2's reduced shards and the last bucket beside them, in device memory
    for tier in ("cpu", "nvme"):
        e = est[tier]
        assert e.offloaded == moments and e.optimizer + e.offloaded == est[None].optimizer
        assert e.peak <= est[None].peak - moments  # off the device, and the gradients too
        # The gradients go to the host bucket by bucket in backward: on the device, the bucket
        # in flight and its shard (one bucket here: the model is smaller than the default).
        total = sum(x.numel() for x in optree.tree_leaves(params))
        assert e.placed_grads == 0 and e.grads == total * 4 + total * 4 // 2
        # The update's staging: parameters per bucket in flight, and for NVMe the moments too
        # (the gradients it reads where backward put them, on the host).
        assert e.staging == 2 * 2048 * 4 * (1 if tier == "cpu" else 3) + grads
        assert e.host == (moments if tier == "cpu" else 0) + e.staging
        assert any("offloaded" in n for n in e.notes) and any("gradients copied to the host" in n for n in e.notes)
    # ZeRO-3: each reduce-scattered gradient goes to the host once it is done.
    z3 = {tier: fs.estimate_memory(params, fs.parallel.zero(3, **kw)(P(), params), opt, mesh=mesh)
          for tier, kw in ((None, {}), ("cpu", dict(offload_optimizer="cpu", bucket_elems=2048)))}
    assert z3["cpu"].placed_grads == 0 < z3[None].placed_grads and z3["cpu"].grads == 0
    assert z3["cpu"].staging == 2 * 2048 * 4 + z3[None].grads
