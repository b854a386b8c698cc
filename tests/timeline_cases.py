"""fsharded.timeline on real ranks (tests/test_timeline.py): a ZeRO-3 GPT step recorded."""

from __future__ import annotations

import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt


def zero3_step(stage: int = 3, transport: str = "auto") -> dict:
    import os
    import tempfile

    import torch.distributed as dist

    if transport == "gloo":
        os.environ["FSHARDED_SHM"] = "0"
    cfg = gpt.GPTConfig.tiny(vocab_size=64)
    params = gpt.init(cfg, 0)
    batch = {"tokens": torch.randint(0, 64, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))}
    mesh = fs.Mesh({"data": 2})
    plan = fs.parallel.zero(stage, min_size=16)(P(), params)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=mesh, param_specs=plan, blocks="blocks")
    state = step.init(params)
    man = step.collectives(state, batch)
    state, _ = step(state, batch)  # the first call agrees on the schedule: not recorded
    with fs.timeline.record() as tl:
        state, _ = step(state, batch)
    with tempfile.TemporaryDirectory() as d:  # what a job writes for a notebook to read
        tl.save(os.path.join(d, "t.json"))
        loaded = fs.timeline.Timeline.load(os.path.join(d, "t.json"))
    return {"rank": dist.get_rank(), "timeline": tl, "loaded": loaded, "manifest": list(man), "text": tl.text()}
