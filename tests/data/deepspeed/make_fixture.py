"""Regenerate the DeepSpeed checkpoints the tests read (needs DeepSpeed; the tests don't).

    python tests/data/deepspeed/make_fixture.py          # all of them
    python tests/data/deepspeed/make_fixture.py bf16     # only the bf16 ones (or: fp32)

DeepSpeed 0.19.8 on 2 gloo ranks trains the tiny GPT (as an nn.Module whose parameters
are named ``blocks.0.attn__wq``, ...) one AdamW step at ZeRO stage 1, 2 and 3, saves a
checkpoint, and records what the tests compare against: the fp32 weights as DeepSpeed's
own ``get_fp32_state_dict_from_zero_checkpoint`` reconstructs them, then the loss of a
second step and the weights after it (so moments and step counts are checked through the
update they produce).

bf16 (``"bf16": {"enabled": true}``, ``worker_bf16``, ``reference_bf16.pt``): one step, a
checkpoint, then ``BF16_STEPS`` more steps whose losses are recorded. The checkpoints
kept are the two layouts DeepSpeed writes for bf16 ZeRO-1:

- ``bf16_zero1``: the default config (bf16 gradient accumulation): DeepSpeed's ZeRO
  optimizer, ZeRO-1/2's layout in ``bf16_zero_pp_rank_*`` files;
- ``bf16_zero1_fp32acc``, on 3 ranks (so that the last partition is padded): ``"data_types":
  {"grad_accum_dtype": "fp32"}``, its ``BF16_Optimizer``, whose partitions keep their
  padding and which records no zero stage (so DeepSpeed's own ``zero_to_fp32`` refuses it:
  "is not a zero checkpoint").

``bf16_zero2`` (ZeRO-1's layout with ``zero_stage`` 2) and ``bf16_zero3`` (ZeRO-3's fp32
layout: ``bf16_zero_pp_rank_*_optim_states.pt`` beside ``zero_pp_rank_*_model_states.pt``)
are written by the DeepSpeed-installed test only. Stage 0 in bf16 writes no ZeRO files:
``mp_rank_00_model_states.pt`` holds DeepSpeed's FP16_UnfusedOptimizer state and no
``param_shapes`` (with fp32 gradient accumulation DeepSpeed refuses stage 0 in bf16).

Recorded per case: the fp32 master weights and Adam moments as DeepSpeed assembles them
from the live engine (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``),
checked equal to its ``zero_to_fp32`` where that reads the checkpoint, and the losses of
the next steps (the mean of the ranks' losses). Where cases agree bit for bit (in 0.19.8
the 2-rank ones do after one step: the same bf16 forward, gradients averaged over two
ranks) their tensors are stored once (pickle's memo), which keeps the file small."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(d_model=16, n_layers=1, n_heads=2, seq_len=16, vocab_size=64)


BF16_STEPS = 3  # DeepSpeed's steps after a bf16 checkpoint whose losses are recorded
FP32_ACC = {"data_types": {"grad_accum_dtype": "fp32"}}  # DeepSpeed's BF16_Optimizer at stage 1
# fixture directory -> (ZeRO stage, DeepSpeed config entries beside "bf16": {"enabled": true},
# data-parallel ranks; each trains on 2 rows of the global batch)
BF16_CASES = {
    "bf16_zero1": (1, {}, 2),
    # 3 ranks: 4592 parameters are no multiple of 2 x 3, so the last partition ends in padding
    "bf16_zero1_fp32acc": (1, FP32_ACC, 3),
    "bf16_zero2": (2, {}, 2),
    "bf16_zero3": (3, {}, 2),
}
# Committed: ZeRO-2 and ZeRO-3 have the fp32 layouts under bf16_ names (the tests rename the
# fp32 fixtures' files to check the names; the DeepSpeed-installed test writes them).
BF16_KEPT = ("bf16_zero1", "bf16_zero1_fp32acc")


def batches(n: int = 2, rows: int = 4):
    """``n`` global batches (rows, T + 1); the first ones are the same for any ``n``."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CONFIG["vocab_size"], (rows, CONFIG["seq_len"] + 1), generator=g) for _ in range(n)]


def worker(root: str) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from fsharded.bench import zero as Z
    from fsharded.models import gpt

    config = gpt.GPTConfig(**CONFIG)
    params = gpt.init(config, 0)
    rank = torch.distributed.get_rank()
    out = {}
    b1, b2 = batches()
    for i, stage in enumerate((1, 2, 3)):
        zj = Z.Job(model=dataclasses.asdict(config), batches=(), stages=(stage,), micro=2,
                   extensions_dir=os.path.join(tempfile.gettempdir(), "fsharded-bench-zero-extensions"))
        if i == 0:
            Z._init_deepspeed(zj)
        ds = Z._DeepSpeed(zj, stage, params)
        ds({}, {"tokens": b1[2 * rank:2 * rank + 2]})
        d = os.path.join(root, f"zero{stage}")
        ds.engine.save_checkpoint(d, tag="step1")
        torch.distributed.barrier()
        loss2 = ds({}, {"tokens": b2[2 * rank:2 * rank + 2]})
        loss2 = loss2.clone()
        torch.distributed.all_reduce(loss2)
        ds.engine.save_checkpoint(os.path.join(root, f"after{stage}"), tag="step2")
        torch.distributed.barrier()
        if rank == 0:
            out[stage] = {
                "fp32": {k: v.clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(d).items()},
                "loss2": float(loss2) / 2,
                "fp32_after": {k: v.clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(
                    os.path.join(root, f"after{stage}")).items()},
            }
    return out


def _bf16_engine(zj, stage: int, extra: dict, params: dict):
    """DeepSpeed on the bench's module and AdamW (as ``bench.zero._DeepSpeed``), in bf16."""
    import deepspeed
    import torch.distributed as dist

    from fsharded.bench import zero as Z
    from fsharded.bench._zero_peers import FunctionalGPT

    cfg = {**Z._deepspeed_config(zj, stage), "bf16": {"enabled": True}, **extra}
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = FunctionalGPT(params)
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if dist.get_rank() == 0:
                model.load_functional(params)
    else:
        model = FunctionalGPT(params)
    engine, *_ = deepspeed.initialize(model=model, optimizer=Z._client_adamw(model.parameters(), zj), config=cfg)
    return engine


def _mean_loss(engine, tokens: torch.Tensor) -> float:
    """One DeepSpeed step on this rank's rows; the mean of the ranks' losses."""
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    total = loss.detach().to(torch.float64).reshape(1)
    torch.distributed.all_reduce(total)
    return float(total) / torch.distributed.get_world_size()


def worker_bf16(root: str, cases=BF16_KEPT) -> dict:
    """Write those of ``cases`` (names of ``BF16_CASES``) saved by this many ranks under
    ``root``; rank 0 returns their reference."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from fsharded.bench import zero as Z
    from fsharded.models import gpt

    config = gpt.GPTConfig(**CONFIG)
    params = gpt.init(config, 0)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = slice(2 * rank, 2 * rank + 2)
    bs = batches(1 + BF16_STEPS, rows=2 * world)
    zj = Z.Job(model=dataclasses.asdict(config), batches=(), stages=(), micro=2,
               extensions_dir=os.path.join(tempfile.gettempdir(), "fsharded-bench-zero-extensions"))
    Z._init_deepspeed(zj)
    out = {}
    for case in (c for c in cases if BF16_CASES[c][2] == world):
        stage, extra, _ = BF16_CASES[case]
        engine = _bf16_engine(zj, stage, extra, params)
        _mean_loss(engine, bs[0][rows])
        named = list(engine.module.named_parameters())
        live = {kind: {n: get(p).detach().float().cpu().clone() for n, p in named}  # collectives: every rank
                for kind, get in (("fp32", safe_get_full_fp32_param),
                                  ("exp_avg", lambda p: safe_get_full_optimizer_state(p, "exp_avg")),
                                  ("exp_avg_sq", lambda p: safe_get_full_optimizer_state(p, "exp_avg_sq")))}
        d = os.path.join(root, case)
        engine.save_checkpoint(d, tag="step1")
        torch.distributed.barrier()
        losses = [_mean_loss(engine, b[rows]) for b in bs[1:]]
        if rank == 0:
            try:  # DeepSpeed's own consolidation, where it reads the checkpoint
                ours = get_fp32_state_dict_from_zero_checkpoint(d)
                zero_to_fp32 = "equal" if all(torch.equal(ours[n], w) for n, w in live["fp32"].items()) \
                    else "differs"
            except ValueError as e:
                zero_to_fp32 = f"refused: {e}".replace(root + os.sep, "")
            assert zero_to_fp32 != "differs", case
            for kind, tensors in live.items():  # the same values as an earlier case's: stored once
                live[kind] = next((o[kind] for o in out.values() if o[kind].keys() == tensors.keys()
                                   and all(torch.equal(o[kind][n], x) for n, x in tensors.items())), tensors)
            out[case] = {**live, "stage": stage, "optimizer": type(engine.optimizer).__name__,
                         "files": sorted(os.listdir(os.path.join(d, "step1"))), "zero_to_fp32": zero_to_fp32,
                         "world": world, "batches": bs, "losses": losses}
        engine.destroy()
        torch.distributed.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, HERE)
    from fsharded.testing import run_on_ranks

    which = set(argv if argv else ("fp32", "bf16"))
    root = tempfile.mkdtemp(prefix="ds-fixture-")
    dirs = []
    if "fp32" in which:
        ref = run_on_ranks(worker, 2, root)[0]
        torch.save({"config": CONFIG, "batches": batches(), "reference": ref}, os.path.join(HERE, "reference.pt"))
        dirs += [f"zero{stage}" for stage in (1, 2, 3)]
    if "bf16" in which:
        ref = {}
        for world in sorted({BF16_CASES[c][2] for c in BF16_KEPT}):
            ref.update(run_on_ranks(worker_bf16, world, root)[0])
        torch.save({"config": CONFIG, "reference": ref}, os.path.join(HERE, "reference_bf16.pt"))
        dirs += list(BF16_KEPT)
    for name in dirs:
        src, dst = os.path.join(root, name), os.path.join(HERE, name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py"))  # DeepSpeed's scripts
    shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
