"""The ``pipeline`` section of a training config: how a mesh's ``pipe`` axis runs the model."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineConfig", "PIPELINE_SCHEDULES"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class PipelineConfig:
    """With a ``pipe`` axis in the mesh: the schedule each rank along it runs, the
    micro-batches per step and the stages per rank. The micro-batches are the step's
    gradient accumulation (as DeepSpeed's pipeline engine counts them):
    ``train_batch_size = micro_batch_size * microbatches * mesh['data']``."""

    schedule: str = "1f1b"
    """One of ``gpipe 1f1b interleaved zb`` (zb: zero-bubble, ZB-H1's memory)."""
    microbatches: int | None = None
    """Micro-batches per step (``None``: ``grad_accum_steps``; giving it sets that)."""
    virtual_stages: int | None = None
    """Stages per rank (``None``: 2 for ``interleaved``, else 1)."""

    def __post_init__(self) -> None:
        errors = []
        if self.schedule not in PIPELINE_SCHEDULES:
            errors.append(f"  pipeline.schedule: expected one of {', '.join(PIPELINE_SCHEDULES)}, got "
                          f"{self.schedule!r}")
        for name in ("microbatches", "virtual_stages"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                errors.append(f"  pipeline.{name}: expected an int >= 1 or None, got {v!r}")
        if self.virtual_stages not in (None, 1) and self.schedule != "interleaved":
            errors.append(f"  pipeline.virtual_stages: {self.virtual_stages} stages per rank need "
                          f"schedule=interleaved (got {self.schedule!r})")
        if errors:
            raise ValueError("invalid PipelineConfig:\n" + "\n".join(errors))

    @property
    def stages_per_rank(self) -> int:
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule == "interleaved" else 1
