"""Generation with a key/value cache for the bundled GPT.

>>> import fsharded as fs
>>> from fsharded.models import gpt
>>> params = gpt.init(gpt.GPTConfig.tiny(), 0)
>>> out = fs.inference.generate(params, [[1, 2, 3], [4, 5]], max_new_tokens=4)
>>> [len(t) for t in out.tokens]
[4, 4]

``generate`` prefills the prompts (left-padded to the longest) into a static,
preallocated ``KVCache`` and decodes one token per step, greedy or sampled with an
explicit key (``sample``). ``extend`` is the cached forward itself. ``quantize`` stores
the projections as int8 weights with per-channel or group-wise scales (``Int8Weight``),
multiplied with the weights dequantized inside the product. ``generate(..., mesh=)``
decodes tensor- and expert-parallel, on the virtual mesh or on real ranks
(``mesh_specs``: how the parameters are laid out). ``Engine`` serves requests by
continuous batching over a ``PagedKVCache`` (``fsharded serve``). ``stream_weights``
keeps the blocks in host memory or files and reads them per layer (ZeRO-Inference).
"""

from fsharded.inference._cache import KVCache
from fsharded.inference._engine import Engine, Event, Request
from fsharded.inference._export import to_transformers
from fsharded.inference._generate import Generation, generate
from fsharded.inference._gpt import extend
from fsharded.inference._int8 import Int8Linear, Int8Weight, quantize
from fsharded.inference._paged import PagedKVCache
from fsharded.inference._safetensors import load_safetensors, safetensors_config
from fsharded.inference._sample import sample
from fsharded.inference._sharded import mesh_specs
from fsharded.inference._stream import StreamedBlocks, stream_weights

__all__ = ["KVCache", "Generation", "generate", "extend", "sample", "quantize", "Int8Weight", "Int8Linear", "mesh_specs",
           "to_transformers", "Engine", "Request", "Event", "PagedKVCache",
           "stream_weights", "StreamedBlocks", "load_safetensors", "safetensors_config"]
