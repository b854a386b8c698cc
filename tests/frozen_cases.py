"""Fine-tuning a part of a model: frozen parameters through ``fs.nn.functional`` and
``train_step``, as cases that run unchanged on the virtual mesh and on gloo ranks.

The model is written the way PyTorch projects write one (an ``nn.Module`` with a
``ModuleList`` of blocks, an embedding and a head); its first block and the embedding are
frozen with ``requires_grad_(False)``, the usual way to fine-tune part of a model.
"""

from __future__ import annotations

import copy

import optree
import torch
from torch import nn

import fsharded as fs
from fsharded import P

LR, STEPS = 0.1, 3


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model() -> Net:
    torch.manual_seed(0)
    m = Net()
    m.embed.requires_grad_(False)
    m.blocks[0].requires_grad_(False)
    return m


def batches(n: int = STEPS, rows: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"idx": torch.randint(0, 32, (rows, 6), generator=g),
             "y": torch.randint(0, 32, (rows, 6), generator=g)} for _ in range(n)]


def plain_pytorch() -> dict:
    """The reference: the module trained by torch.optim.AdamW over its trainable parameters."""
    m = model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
    losses = []
    for b in batches():
        loss = m(b["idx"], b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": {k: v.detach().clone() for k, v in m.named_parameters()}, "losses": losses}


def train(stage: int, data: int, *, blocks: bool = True, donate: bool = False) -> dict:
    """The same fine-tuning through fs.nn.functional and train_step at a ZeRO stage."""
    m = model()
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    fm = fs.nn.functional(m)
    mesh = fs.Mesh({"data": data})
    step = fs.train_step(lambda p, b: fm.apply(p, b["idx"], b["y"]), fs.optim.adamw(LR, weight_decay=0.01),
                         mesh=mesh, param_specs=fs.parallel.zero(stage, min_size=1)(P(), fm.params),
                         blocks=fm.blocks if blocks else None, donate=donate)
    state = step.init(fm.params)
    n_opt = len([x for x in optree.tree_leaves(state.opt_state) if x.dim() > 0])
    losses = []
    for b in batches():
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    full = step.params(state)
    flat = dict(zip(fs.tree_flatten_with_paths(full)[0], optree.tree_leaves(full)))
    return {"params": flat, "before": before, "losses": losses, "opt_leaves": n_opt,
            "trainable": state.trainable, "frozen_dtype": str(flat["embed.weight"].dtype)}


def manifest(stage: int, data: int) -> dict:
    """Bytes of gradient collectives of one step, and the trainable bytes, per rank."""
    m = model()
    fm = fs.nn.functional(m)
    step = fs.train_step(lambda p, b: fm.apply(p, b["idx"], b["y"]), fs.optim.adamw(LR),
                         mesh=fs.Mesh({"data": data}),
                         param_specs=fs.parallel.zero(stage, min_size=1)(P(), fm.params), blocks=fm.blocks)
    state = step.init(fm.params)
    man = step.collectives(state, batches(1)[0])
    grad_ops = [e for e in man if e.phase == "backward" or e.op in ("psum", "pmean", "psum_scatter")]
    return {"ops": [(e.op, e.phase, e.bytes_sent) for e in man],
            "grad_bytes": sum(e.bytes_sent for e in grad_ops),
            "trainable_numel": sum(p.numel() for p in m.parameters() if p.requires_grad),
            "frozen_numel": sum(p.numel() for p in m.parameters() if not p.requires_grad)}


def all_cases(data: int) -> dict:
    return {f"zero{s}": train(s, data) for s in (0, 1, 2, 3)} | {"zero3_noblocks": train(3, data, blocks=False)}


def lora_model(cfg_kind: str = "llama"):
    """A peft LoRA model on a small Hugging Face model built from a config (its default
    attention)."""
    import peft
    import transformers

    torch.manual_seed(0)
    if cfg_kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        base = transformers.LlamaForCausalLM(cfg)
        targets = ["q_proj", "v_proj"]
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        base = transformers.GPT2LMHeadModel(cfg)
        targets = ["c_attn"]
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                           fan_in_fan_out=cfg_kind == "gpt2",  # GPT-2's Conv1D stores weights transposed
                           init_lora_weights=False)  # nonzero B: the adapters change the output
    return peft.get_peft_model(base, lcfg)


def lora_copy(m):
    return copy.deepcopy(m)


def reshard(data: int) -> dict:
    """A stage-0 state's weights made into a ZeRO-3 state with ``step.init(step.params(state))``
    (the reshard recipe), then trained on: which leaves each state trains, and the weights."""
    m = model()
    fm = fs.nn.functional(m)

    def make(stage):
        return fs.train_step(lambda p, b: fm.apply(p, b["idx"], b["y"]), fs.optim.adamw(LR, weight_decay=0.01),
                             mesh=fs.Mesh({"data": data}), blocks=fm.blocks,
                             param_specs=fs.parallel.zero(stage, min_size=1)(P(), fm.params))

    first = make(0)
    state = first.init(fm.params)
    bs = batches()
    state, _ = first(state, bs[0])
    second = make(3)
    again = second.init(first.params(state))
    for b in bs[1:]:
        again, _ = second(again, b)
    full = second.params(again)
    return {"first": state.trainable, "second": again.trainable,
            "params": dict(zip(fs.tree_flatten_with_paths(full)[0], optree.tree_leaves(full)))}


def by_size(data: int) -> list:
    """ZeRO-3 with trainable= a function of the leaves' sizes (global ones at init; a step
    holds shards): which leaves the state trains after a step."""
    m = model()
    fm = fs.nn.functional(m)
    step = fs.train_step(lambda p, b: fm.apply(p, b["idx"], b["y"]), fs.optim.adamw(LR), mesh=fs.Mesh({"data": data}),
                         param_specs=fs.parallel.zero(3, min_size=1)(P(), fm.params), blocks=fm.blocks,
                         trainable=lambda path, x: x.numel() > 600)
    state = step.init(fm.params)
    state, _ = step(state, batches(1)[0])
    return state.trainable.tolist()
