"""Reference models as pure functions over parameter pytrees, in per-shard form.

>>> from fsharded.models import gpt
>>> params = gpt.init(gpt.GPTConfig.tiny(), seed=0)
>>> gpt.param_count(params)
7872
"""

from fsharded.models import gpt
from fsharded.models.gpt import GPTConfig

__all__ = ["gpt", "GPTConfig"]
