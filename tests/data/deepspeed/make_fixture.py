"""Regenerate the DeepSpeed checkpoints the tests read (needs DeepSpeed; the tests don't).

    python tests/data/deepspeed/make_fixture.py

DeepSpeed 0.19.8 on 2 gloo ranks trains the tiny GPT (as an nn.Module whose parameters
are named ``blocks.0.attn__wq``, ...) one AdamW step at ZeRO stage 1, 2 and 3, saves a
checkpoint, and records what the tests compare against: the fp32 weights as DeepSpeed's
own ``get_fp32_state_dict_from_zero_checkpoint`` reconstructs them, then the loss of a
second step and the weights after it (so moments and step counts are checked through the
update they produce)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(d_model=16, n_layers=1, n_heads=2, seq_len=16, vocab_size=64)


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CONFIG["vocab_size"], (4, CONFIG["seq_len"] + 1), generator=g) for _ in range(2)]


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


def main() -> int:
    sys.path.insert(0, HERE)
    from fsharded.testing import run_on_ranks

    root = tempfile.mkdtemp(prefix="ds-fixture-")
    ref = run_on_ranks(worker, 2, root)[0]
    for stage in (1, 2, 3):
        src, dst = os.path.join(root, f"zero{stage}"), os.path.join(HERE, f"zero{stage}")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py"))  # DeepSpeed's scripts
    torch.save({"config": CONFIG, "batches": batches(), "reference": ref}, os.path.join(HERE, "reference.pt"))
    shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
