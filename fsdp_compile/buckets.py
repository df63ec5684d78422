"""Which parameters share one all-gather and one reduce-scatter: the bucket plan.

A bucket is a run of parameters, consecutive in the order the forward first reads them, that
share a key: their ``fully_shard`` unit, or, when the root was the only unit, the repeated block
their fqn names (``layers.3.`` of ``layers.3.attn.wqkv.weight``), plus whether they are freed
after forward, their process groups, strategy, wire dtype and gradient-reduction dtype, so a
bucket never mixes groups, strategies, dtypes or reshard decisions. A run longer than the byte
cap is split greedily; a parameter larger than the cap is a bucket of its own.

Parameters kept gathered from forward to backward (the root's own under NOTE: the reshard
default, in fsdp_compile/api.py) form one bucket per key wherever the forward reads them:
the embedding at the start, the final norm at the end. Splitting them would save no memory
where it matters (they are all alive from the end of forward to the start of backward, the
step's peak) and costs a collective each way: one bucket is what FSDP2 gathers for its root.
Parameters freed after forward form one bucket per run instead (an embedding freed after its
lookup is not gathered again with the head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from fsdp_compile.api import repeated_block

if TYPE_CHECKING:
    from fsdp_compile.plan import ParamPlan

__all__ = ["BucketPlan", "plan_buckets"]


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """One all-gather (and, for its trainable members, one reduce-scatter) per graph."""

    index: int
    """Position in the forward's first-read order; the key graphs tag their collectives with."""
    name: str
    """The members' common module path (``layers.3``), or ``<root>`` when they share none."""
    param_ids: tuple[int, ...]
    """Members, in first-read order; their shards lie in this order in the bucket buffer."""
    group_name: str
    reshard_after_forward: bool
    """Freed after forward and gathered again in backward; False: kept gathered from its
    forward use to its backward use (see NOTE: the reshard default, in fsdp_compile/api.py)."""
    param_dtype: str
    """Dtype of the all-gather: the members' wire dtype, or ``uint8`` when float8 weights
    and others share it (each member's bytes packed as they are)."""
    reduce_dtype: str
    """Dtype of the reduce-scatter."""
    gathered_bytes: int
    """Bytes of the gathered bucket (padded rows of every member, all ranks)."""


def _common_path(fqns: Sequence[str]) -> str:
    parts = [fqn.split(".")[:-1] for fqn in fqns]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common) or "<root>"


def _gather_dtype(run: Sequence[ParamPlan]) -> str:
    dtypes = {p.wire_dtype for p in run}
    return dtypes.pop() if len(dtypes) == 1 else "uint8"


def plan_buckets(
    params: Sequence[ParamPlan],
    read_order: Sequence[int],
    *,
    enabled: bool,
    cap_bytes: int | None,
) -> tuple[BucketPlan, ...]:
    """Group ``params`` into buckets (see the module docstring).

    ``read_order`` lists ``param_id``s as the forward first reads them; parameters it misses
    follow in plan order. ``enabled=False`` gives one bucket per parameter (the unbucketed
    schedule); ``cap_bytes=None`` leaves runs unsplit.
    """
    by_id = {p.param_id: p for p in params}
    ordered = [by_id[i] for i in dict.fromkeys(read_order) if i in by_id]
    ordered += [p for p in params if p.param_id not in set(read_order)]
    one_unit = len({p.unit for p in params}) == 1

    def key(p: ParamPlan) -> tuple:
        # The strategy and replicate group decide which collectives a member has at all.
        return (
            repeated_block(p.fqn) if one_unit else p.unit,
            p.reshard_after_forward,
            p.group_name,
            p.replicate_group_name,
            p.strategy,
            # The compute dtype, not the wire's: a float8 weight shares its unit's bucket
            # (bytes packed byte-exactly, see NOTE: bucket layout in bucket_collectives).
            p.param_dtype,
            p.reduce_dtype,
        )

    def fits(run: list[ParamPlan] | None, param: ParamPlan) -> bool:
        return run is not None and (
            cap_bytes is None or sum(p.gathered_bytes for p in run) + param.gathered_bytes <= cap_bytes
        )

    runs: list[list[ParamPlan]] = []
    kept: dict[tuple, list[ParamPlan]] = {}  # the open bucket of each key kept gathered
    for param in ordered:
        last = runs[-1] if runs else None
        if not param.reshard_after_forward:
            last = kept.get(key(param))
        if enabled and fits(last, param) and key(last[0]) == key(param):
            last.append(param)
        else:
            runs.append([param])
            if not param.reshard_after_forward:
                kept[key(param)] = runs[-1]
    return tuple(
        BucketPlan(
            index=i,
            name=_common_path([p.fqn for p in run]),
            param_ids=tuple(p.param_id for p in run),
            group_name=run[0].group_name,
            reshard_after_forward=run[0].reshard_after_forward,
            param_dtype=_gather_dtype(run),
            reduce_dtype=run[0].reduce_dtype,
            gathered_bytes=sum(p.gathered_bytes for p in run),
        )
        for i, run in enumerate(runs)
    )
