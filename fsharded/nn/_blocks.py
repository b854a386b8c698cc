"""Where a module keeps its repeated blocks: an explicit path, a known layout, or the
largest ``nn.ModuleList`` whose children are all one class."""

from __future__ import annotations

from torch import nn

__all__ = ["KNOWN_LAYOUTS", "find_blocks"]

# Dotted path of the block list -> the projects that lay their models out so.
KNOWN_LAYOUTS: dict[str, str] = {
    "transformer.h": "nanoGPT / Hugging Face GPT-2",
    "model.layers": "Hugging Face Llama / Mistral / Qwen2",
    "gpt_neox.layers": "Hugging Face GPT-NeoX / Pythia",
    "model.decoder.layers": "Hugging Face OPT",
    "transformer.blocks": "MPT",
}


def _uniform(m: nn.Module) -> bool:
    """A non-empty ModuleList of children of one class that hold parameters."""
    if not isinstance(m, nn.ModuleList) or len(m) == 0:
        return False
    return len({type(k) for k in m}) == 1 and any(True for _ in m.parameters())


def _describe(path: str, m: nn.ModuleList) -> str:
    return f"{path}, {len(m)} x {type(m[0]).__name__}"


def _module_lists(module: nn.Module) -> list[str]:
    return [f"{name} ({len(m)} children)" for name, m in module.named_modules()
            if isinstance(m, nn.ModuleList) and name]


def find_blocks(module: nn.Module, blocks: str | bool | None) -> tuple[str | None, str]:
    """``(path or None, how it was found)`` for ``functional(module, blocks=...)``."""
    if blocks is False:
        return None, "off (blocks=False)"
    if isinstance(blocks, str):
        try:
            m = module.get_submodule(blocks)
        except AttributeError:
            lists = _module_lists(module)
            raise ValueError(
                f"fs.nn.functional(blocks={blocks!r}): {type(module).__name__} has no submodule "
                f"{blocks!r}; its ModuleLists are {lists or 'none'}. Pass one of them, or "
                f"blocks=None to find it, or blocks=False for no per-block gathering"
            ) from None
        if not isinstance(m, nn.ModuleList):
            raise ValueError(
                f"fs.nn.functional(blocks={blocks!r}): {blocks!r} is a {type(m).__name__}, not an "
                f"nn.ModuleList of blocks; its ModuleLists are {_module_lists(module) or 'none'}"
            )
        if len(m) == 0:
            raise ValueError(f"fs.nn.functional(blocks={blocks!r}): the ModuleList {blocks!r} is empty")
        return blocks, f"given: {_describe(blocks, m)}"
    if blocks is not None:
        raise TypeError(f"fs.nn.functional: blocks must be a dotted path, None (find it) or False, got {blocks!r}")
    # By the modules' own names (a wrapper such as peft's PeftModel forwards attribute
    # access to the model inside it, so get_submodule would find a path its parameters do
    # not have): the layout's path, or the same under a wrapper's prefix.
    real = dict(module.named_modules())
    for path, who in KNOWN_LAYOUTS.items():
        hits = sorted((n for n in real if n == path or n.endswith("." + path)), key=len)
        for n in hits:
            if _uniform(real[n]):
                return n, f"found: the {who} layout ({_describe(n, real[n])})"
    best, size = None, 0
    for name, m in module.named_modules():
        if name and _uniform(m):
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = name, n
    if best is None:
        return None, "none found (no nn.ModuleList of same-class children with parameters)"
    return best, (f"found: the largest nn.ModuleList of same-class children "
                  f"({_describe(best, module.get_submodule(best))}, {size:,} parameters)")
