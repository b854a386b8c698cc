"""``nn.Module`` <-> pure function: parameters by name, tied weights, block lists, and
writing trained weights back.

>>> fm = fs.nn.functional(model)      # model: a nanoGPT GPT, a HF LlamaForCausalLM, ...
>>> fm.blocks, fm.blocks_origin       # 'transformer.h', 'found: the nanoGPT / ... layout'
>>> plan = fs.parallel.zero(3)(fs.P(), fm.params)
>>> step = fs.train_step(loss, fs.optim.adamw(3e-4), mesh=mesh, param_specs=plan, blocks=fm.blocks)
>>> fs.nn.load_into(model, step.params(state))
"""

from fsharded.nn._blocks import KNOWN_LAYOUTS
from fsharded.nn._functional import FunctionalModule, functional
from fsharded.nn._load import LoadResult, load_into
from fsharded.nn._pipeline import ModuleStages, pipeline_stages
from fsharded.nn._sequence import (
    IGNORE,
    SequenceParallel,
    causal_lm_loss,
    sequence_attention,
    sequence_parallel,
)

__all__ = ["functional", "FunctionalModule", "load_into", "LoadResult", "KNOWN_LAYOUTS", "sequence_parallel",
           "SequenceParallel", "sequence_attention", "causal_lm_loss", "IGNORE", "pipeline_stages", "ModuleStages"]
