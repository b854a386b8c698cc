"""``GPTConfig``: the hyperparameters of the reference GPT, validated at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["GPTConfig", "MoEConfig", "TENSOR", "EXPERT"]

TENSOR = "tensor"  # the mesh axis Megatron tensor parallelism shards over, by default
EXPERT = "expert"  # the mesh axis expert parallelism splits the experts over, by default

_CHOICES = {
    "norm": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "swiglu"),
    "positions": ("learned", "rotary"),
}


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts in the GPT (``fsharded.parallel.moe``): every ``every``-th
    block's MLP (blocks ``every - 1``, ``2 * every - 1``, ...) becomes ``experts`` GELU
    MLPs behind a top-``top_k`` router. Routing options are ``fsharded.parallel.moe.route``'s;
    they are not in the parameter tree, so ``gpt.apply``/``gpt.loss`` take this config as
    ``moe=``.

    >>> MoEConfig(experts=8, top_k=2).capacity_factor
    1.25
    """

    experts: int = 8
    """Experts per MoE layer (E); an ``expert`` mesh axis must divide it."""
    top_k: int = 2
    """Experts each token goes to (1: Switch, 2: GShard)."""
    capacity_factor: float | None = 1.25
    """Training capacity: ``ceil(top_k * tokens * capacity_factor / experts)`` slots per
    expert per shard (at least ``min_capacity``); ``None``: dropless."""
    eval_capacity_factor: float | None = 2.0
    """The same for evaluation (``train=False``)."""
    min_capacity: int = 4
    """Fewest slots per expert."""
    every: int = 2
    """An MoE layer every this many blocks (1: every block)."""
    d_ff: int | None = None
    """Hidden width of each expert; ``None``: the dense MLP's ``d_ff``."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss (summed over the MoE layers) in the loss."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss (summed over the MoE layers) in the loss."""
    bias_update_rate: float | None = None
    """Aux-loss-free balancing (DeepSeek-V3): each MoE layer's experts are chosen by the
    router's probabilities plus a per-expert bias, carried in ``TrainState.model_state``
    (``gpt.init_model_state``) and moved by this much per step toward a uniform load
    (``fsharded.parallel.moe.update_bias``; DeepSeek-V3 used 0.001); ``None``: no bias."""

    def __post_init__(self) -> None:
        errors = []
        for name in ("experts", "top_k", "every", "min_capacity"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "min_capacity" else 1):
                errors.append(f"moe.{name} must be a positive int, got {v!r}")
        if not errors and self.top_k > self.experts:
            errors.append(f"moe.top_k ({self.top_k}) exceeds moe.experts ({self.experts}): use top_k <= experts")
        for name in ("capacity_factor", "eval_capacity_factor"):
            v = getattr(self, name)
            if v is not None and not _positive_number(v):
                errors.append(f"moe.{name} must be a positive number or None (dropless), got {v!r}")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or isinstance(self.d_ff, bool) or self.d_ff < 1):
            errors.append(f"moe.d_ff must be a positive int or None, got {self.d_ff!r}")
        v = self.bias_update_rate
        if v is not None and not _positive_number(v):
            errors.append(f"moe.bias_update_rate must be a positive number or None (no bias), got {v!r}")
        for name in ("aux_loss_weight", "z_loss_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                errors.append(f"moe.{name} must be a number >= 0, got {v!r}")
        if errors:
            raise ValueError("invalid MoEConfig:\n" + "\n".join(f"  {e}" for e in errors))

    @classmethod
    def from_deepspeed(cls, *, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                       eval_capacity_factor: float = 1.0, min_capacity: int = 4, drop_tokens: bool = True,
                       use_rts: bool = True, noisy_gate_policy: str | None = None, use_residual: bool = False,
                       top2_2nd_expert_sampling: bool = True, enable_expert_tensor_parallelism: bool = False,
                       use_tutel: bool = False, ep_size: int | None = None, hidden_size: int | None = None,
                       expert: Any = None, **ours: Any) -> MoEConfig:
        """The config of DeepSpeed's ``deepspeed.moe.layer.MoE(hidden_size, expert, ...)``
        arguments (DeepSpeed's JSON config has no MoE keys: its layers are configured in
        code). ``hidden_size`` and ``expert`` are the model's (``d_model``, the dense MLP;
        accepted and not used); ``ep_size`` is the mesh's ``expert`` axis (``--mesh
        expert=N``), not a routing setting, and must divide ``num_experts``;
        ``enable_expert_tensor_parallelism`` is a ``tensor`` mesh axis here (``--mesh
        tensor=T,expert=N``: the GPT's tensor-parallel specs split every expert's hidden
        units); ``drop_tokens=False`` is dropless; ``ours``: the fields DeepSpeed leaves to the
        model (``every``, ``d_ff``, ``aux_loss_weight``, ...). What routes differently here
        is refused by name rather than approximated: random token selection at top-1 with
        drops (DeepSpeed's default ``use_rts=True``, which only its top-1 gate reads; ours
        keeps tokens in order), sampling top-2's second expert
        (``top2_2nd_expert_sampling=True``, its default), noisy gates and residual MoE.

        >>> MoEConfig.from_deepspeed(num_experts=8, k=2, capacity_factor=1.25, use_rts=False,
        ...                          top2_2nd_expert_sampling=False).capacity_factor
        1.25
        """
        refused = []
        if use_rts and k == 1 and drop_tokens:
            refused.append("use_rts=True (random token selection at a full expert; here the earlier tokens "
                           "stay): pass use_rts=False")
        if k == 2 and top2_2nd_expert_sampling:
            refused.append("top2_2nd_expert_sampling=True (the second expert drawn with Gumbel noise; here "
                           "it is the second-largest probability): pass top2_2nd_expert_sampling=False")
        if noisy_gate_policy is not None:
            refused.append(f"noisy_gate_policy={noisy_gate_policy!r}: pass None")
        if use_residual:
            refused.append("use_residual=True (residual MoE): pass False")
        if refused:
            raise NotImplementedError("MoEConfig.from_deepspeed: not implemented here:\n"
                                      + "\n".join(f"  {r}" for r in refused))
        if ep_size is not None and (not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size):
            raise ValueError(f"MoEConfig.from_deepspeed: ep_size={ep_size!r} does not divide num_experts="
                             f"{num_experts}: use a divisor of it (it is the mesh's expert axis, --mesh expert=N)")
        # a kernel choice, the mesh's tensor and expert axes, the model's width and dense MLP
        del use_tutel, enable_expert_tensor_parallelism, ep_size, hidden_size, expert
        return cls(experts=num_experts, top_k=k, capacity_factor=capacity_factor if drop_tokens else None,
                   eval_capacity_factor=eval_capacity_factor if drop_tokens else None,
                   min_capacity=min_capacity, **ours)

    def layers(self, n_layers: int) -> list[int]:
        """The blocks whose MLP is a mixture of experts."""
        return [i for i in range(n_layers) if i % self.every == self.every - 1]


@dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of the functional GPT (``fsharded.models.gpt``).

    Only ``init`` reads a config: the architecture is recoverable from the parameter tree,
    so ``apply`` and ``loss`` take none. The defaults are the ``small`` preset, a ~0.84M
    parameter byte-level model that learns visibly in about a minute on two CPU cores.

    >>> GPTConfig(d_model=64, n_heads=4, n_kv_heads=2).head_dim
    16
    >>> GPTConfig.tiny(positions="rotary").positions
    'rotary'
    """

    vocab_size: int = 256
    """Number of token ids; 256 for byte-level text."""
    d_model: int = 128
    """Width of the residual stream (D)."""
    n_layers: int = 4
    """Number of transformer blocks (``len(params["blocks"])``)."""
    n_heads: int = 4
    """Query heads (H); ``d_model`` must be divisible by it, ``head_dim = d_model // n_heads``."""
    n_kv_heads: int | None = None
    """Key/value heads (KV) for grouped-query attention; ``None`` means ``n_heads`` (plain
    multi-head attention), 1 means multi-query. ``n_heads`` must be divisible by it: query
    head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)``."""
    seq_len: int = 128
    """Longest sequence (T): the size of the learned position table, and the window the data
    pipeline cuts. Rotary models can run longer sequences than this."""
    mlp_ratio: float = 4.0
    """MLP hidden width as a multiple of ``d_model``; ``mlp_ratio * d_model`` must be a
    whole number (``d_ff``)."""
    norm: str = "layernorm"
    """``"layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only); eps is 1e-5."""
    activation: str = "gelu"
    """``"gelu"`` (exact erf GELU MLP, ``w_in``/``w_out``) or ``"swiglu"`` (``silu(x W_gate)
    * (x W_up)``, then ``W_down``)."""
    positions: str = "learned"
    """``"learned"`` (a ``(seq_len, D)`` table added to the embeddings) or ``"rotary"``
    (RoPE on queries and keys, theta 10000, half-split layout; needs an even head_dim)."""
    tied_embeddings: bool = True
    """Use ``emb.T`` as the output projection; otherwise a separate ``head`` (D, V)."""
    bias: bool = True
    """Biases on the attention and MLP projections (GPT-2 style); ``False`` for LLaMA style."""
    init_std: float = 0.02
    """Std of the normal init of embeddings and weight matrices; the projections that write
    into the residual stream (``wo``, ``w_out``/``w_down``) use ``init_std / sqrt(2 *
    n_layers)`` so the residual variance does not grow with depth (GPT-2)."""
    moe: MoEConfig | None = None
    """Mixture of experts in every ``moe.every``-th block (a ``MoEConfig`` or a dict of its
    fields); ``None``: every MLP dense."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if isinstance(self.moe, dict):
            unknown = sorted(set(self.moe) - {f.name for f in dataclasses.fields(MoEConfig)})
            if unknown:
                raise ValueError(f"invalid GPTConfig:\n  moe: unknown field(s) {unknown}; known: "
                                 f"{[f.name for f in dataclasses.fields(MoEConfig)]}")
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        errors = []
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                errors.append(f"{name} must be a positive int, got {v!r}")
        for name, choices in _CHOICES.items():
            v = getattr(self, name)
            if v not in choices:
                errors.append(f"{name} must be one of {list(choices)}, got {v!r}")
        for name in ("tied_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _positive_number(self.init_std):
            errors.append(f"init_std must be a positive number, got {self.init_std!r}")
        if not _positive_number(self.mlp_ratio):
            errors.append(f"mlp_ratio must be a positive number, got {self.mlp_ratio!r}")
        elif isinstance(self.d_model, int) and (
            not float(self.mlp_ratio * self.d_model).is_integer()
        ):
            errors.append(
                f"mlp_ratio * d_model = {self.mlp_ratio} * {self.d_model} = "
                f"{self.mlp_ratio * self.d_model} is not a whole number; pick a mlp_ratio "
                f"that gives an integer MLP width"
            )
        if not errors:  # the checks below need valid ints
            if self.d_model % self.n_heads:
                errors.append(
                    f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
                )
            if self.n_heads % self.n_kv_heads:
                errors.append(
                    f"n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                    f"({self.n_kv_heads}) for grouped-query attention"
                )
            elif self.positions == "rotary" and (self.d_model // self.n_heads) % 2:
                errors.append(
                    f"rotary positions need an even head_dim, got d_model // n_heads = "
                    f"{self.d_model} // {self.n_heads} = {self.d_model // self.n_heads}"
                )
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            errors.append(f"moe must be a MoEConfig, a dict of its fields or None, got {type(self.moe).__name__}")
        if errors:
            raise ValueError("invalid GPTConfig:\n" + "\n".join(f"  {e}" for e in errors))
        if self.moe is not None and self.activation != "gelu":
            raise NotImplementedError("GPTConfig: the MoE experts are GELU MLPs; activation='swiglu' with moe "
                                      "is not implemented (use activation='gelu')")

    # -- derived sizes ----------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        """Per-head width (Dh)."""
        return self.d_model // self.n_heads

    @property
    def d_ff(self) -> int:
        """MLP hidden width (F)."""
        return int(self.mlp_ratio * self.d_model)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ``ValueError`` unless the model splits evenly over ``tp`` tensor shards.

        Megatron sharding splits query heads, key/value heads and the MLP hidden width, so
        all three must be divisible by ``tp`` (``shard_map`` also checks, per leaf).

        >>> GPTConfig(n_heads=4, n_kv_heads=2).check_tensor_parallel(2)
        """
        errors = [
            f"{name} = {v} is not divisible by the tensor-parallel size {tp}"
            for name, v in (("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads),
                            ("d_ff", self.d_ff))
            if v % tp
        ]
        if errors:
            raise ValueError(
                "GPTConfig cannot be split over the 'tensor' axis:\n"
                + "\n".join(f"  {e}" for e in errors)
                + "\n  use a tensor-parallel size that divides all three, or change the config"
            )

    # -- presets ----------------------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """A model for unit tests (7,872 parameters): 2 layers, D=16, 4 heads, T=16."""
        base = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, seq_len=16)
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> GPTConfig:
        """The default: byte-level, 4 layers, D=128, 4 heads, T=128, ~0.84M parameters."""
        return cls(**overrides)

    @classmethod
    def llama_style(cls, **overrides: Any) -> GPTConfig:
        """``small`` with LLaMA's choices: RMSNorm, SwiGLU (d_ff = 8/3 D rounded to 344),
        rotary positions, grouped-query attention (2 KV heads), no biases, untied head."""
        base = dict(norm="rmsnorm", activation="swiglu", positions="rotary", n_kv_heads=2,
                    bias=False, tied_embeddings=False, mlp_ratio=344 / 128)
        return cls(**{**base, **overrides})

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON values (``moe`` a dict or None): what a checkpoint's
        job record keeps, ``from_dict``'s input."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """The config ``to_dict`` wrote; an unknown setting is an error naming it."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"GPTConfig.from_dict: unknown settings {unknown}; known: {sorted(fields)}")
        moe = d.get("moe")
        return cls(**{**d, "moe": MoEConfig(**moe) if isinstance(moe, dict) else moe})


def _positive_number(v: Any) -> bool:
    return (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    )
