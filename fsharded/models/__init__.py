"""Reference models as pure functions over parameter pytrees, in per-shard form, with
their sharding plans beside them (``gpt_plans``).

>>> from fsharded.models import gpt
>>> params = gpt.init(gpt.GPTConfig.tiny(), seed=0)
>>> gpt.param_count(params)
7872
"""

from fsharded.models import gpt, gpt_plans
from fsharded.models.gpt import GPTConfig

__all__ = ["gpt", "gpt_plans", "GPTConfig"]
