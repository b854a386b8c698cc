"""The ``offload`` section of a training config: where the optimizer state and parameters live."""

from __future__ import annotations

from dataclasses import dataclass

from fsharded.parallel.offload import ZenFlow

__all__ = ["OffloadConfig"]


@dataclass(frozen=True)
class OffloadConfig:
    """The optimizer's moments in device memory (``optimizer="none"``), in host memory
    (``"cpu"``) or in files under ``nvme_path`` (``"nvme"``), streamed through the update
    in buckets (``fsharded.parallel.offload``); needs ``zero_stage`` 1-3, as DeepSpeed's
    ``offload_optimizer`` does. DeepSpeed's ``zero_optimization.offload_optimizer`` block
    maps onto it."""

    optimizer: str = "none"
    """``none``, ``cpu`` or ``nvme``."""
    params: str = "none"
    """Where the master weights' shards live: ``none``, ``cpu`` or ``nvme`` (DeepSpeed's
    ``offload_param``, at ZeRO-3; here ``zero_stage`` 1-3, with ``optimizer`` offloaded too)."""
    nvme_path: str | None = None
    """A directory on the disk that holds the state (``nvme``)."""
    pin_memory: bool = True
    """Page-locked host buffers where a GPU is the device."""
    buffer_count: int = 2
    """Buckets in flight (2: the next bucket is read while this one is updated)."""
    bucket_elems: int = 1 << 22
    """Elements per streamed bucket."""
    zenflow: bool = False
    """ZenFlow's overlapped update (``fsharded.parallel.offload.ZenFlow``; DeepSpeed's
    ``zenflow`` block): the important rows updated on the device each step, the rest one
    step stale on the host beside the next step. Needs ``optimizer`` cpu or nvme, and
    ``params`` none."""
    zenflow_topk_ratio: float = 0.1
    """The fraction of each shard's rows updated on the device."""
    zenflow_select_interval: int = 100
    """Steps between selections of those rows."""
    zenflow_warmup_steps: int = 0
    """First steps run with the exact update."""
    zenflow_update_interval: int = 1
    """Steps whose cold gradients are summed into one host update."""

    def __post_init__(self) -> None:
        errors = []
        if self.optimizer not in ("none", "cpu", "nvme"):
            errors.append(f"  offload.optimizer: expected one of none, cpu, nvme, got {self.optimizer!r}")
        if self.params not in ("none", "cpu", "nvme"):
            errors.append(f"  offload.params: expected one of none, cpu, nvme, got {self.params!r}")
        elif self.params != "none" and self.optimizer == "none":
            errors.append(f"  offload.params={self.params}: needs offload.optimizer cpu or nvme as well (the update "
                          f"streams the parameters with the optimizer state)")
        if "nvme" in (self.optimizer, self.params) and not self.nvme_path:
            errors.append("  offload.nvme_path: offloading to nvme needs a directory to keep the state in")
        for name, least in (("buffer_count", 1), ("bucket_elems", 1024), ("zenflow_select_interval", 1),
                            ("zenflow_warmup_steps", 0), ("zenflow_update_interval", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                errors.append(f"  offload.{name}: expected an int >= {least}, got {v!r}")
        r = self.zenflow_topk_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            errors.append(f"  offload.zenflow_topk_ratio: expected a fraction in (0, 1], got {r!r}")
        if self.zenflow and (self.optimizer not in ("cpu", "nvme") or self.params != "none"):
            errors.append(f"  offload.zenflow: needs offload.optimizer cpu or nvme and offload.params none (its hot "
                          f"rows are updated on the device, the rest by the tier beside the next step), got "
                          f"optimizer {self.optimizer}, params {self.params}")
        if errors:
            raise ValueError("invalid OffloadConfig:\n" + "\n".join(errors))

    @property
    def active(self) -> bool:
        return self.optimizer != "none"

    def zero_kwargs(self) -> dict:
        """``fs.parallel.zero``'s keywords for it ({} without offload)."""
        if not self.active:
            return {}
        return {"offload_optimizer": self.optimizer, "nvme_path": self.nvme_path, "pin_memory": self.pin_memory,
                "buffer_count": self.buffer_count, "bucket_elems": self.bucket_elems,
                **({"offload_params": self.params} if self.params != "none" else {}),
                **({"zenflow": ZenFlow(self.zenflow_topk_ratio, self.zenflow_select_interval,
                                       self.zenflow_warmup_steps, self.zenflow_update_interval)}
                   if self.zenflow else {})}
