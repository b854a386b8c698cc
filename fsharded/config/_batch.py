"""DeepSpeed's batch arithmetic: the global batch, the micro-batch per shard and the
accumulation steps, any two of which give the third."""

from __future__ import annotations

__all__ = ["resolve_batch"]


def resolve_batch(
    train: int | None, micro: int | None, accum: int | None, dp: int, *,
    names: tuple[str, str, str, str], default_micro: int | None,
) -> tuple[int, int, int]:
    """DeepSpeed's rule: any two of (train, micro, accum) give the third (rounding down,
    then checked); train alone means accum = 1; micro alone means accum = 1."""
    n_train, n_micro, n_accum, n_dp = names
    how = ""
    if train is None and micro is None:
        if default_micro is None:
            raise ValueError(f"either {n_train} or {n_micro} must be given")
        micro = default_micro
    if train is not None and micro is not None and accum is None:
        accum = train // micro // dp
        how = f" ({n_accum} derived as {train} // {micro} // {n_dp} {dp})"
    elif train is not None and accum is not None and micro is None:
        micro = train // dp // accum
        how = f" ({n_micro} derived as {train} // {n_dp} {dp} // {accum})"
    elif train is not None and micro is None:
        accum, micro = 1, train // dp
        how = f" ({n_micro} derived as {train} // {n_dp} {dp}, {n_accum} = 1)"
    elif train is None:
        accum = 1 if accum is None else accum
        train = micro * accum * dp
    if micro < 1 or accum < 1 or train != micro * accum * dp:
        raise ValueError(
            f"{n_train} {train} != {n_micro} {micro} * {n_accum} {accum} * {n_dp} {dp} "
            f"= {micro * accum * dp}{how}"
        )
    return train, micro, accum
