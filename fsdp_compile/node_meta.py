"""The keys our passes write into ``fx.Node.meta`` and ``GraphModule.meta``, in one place.

Each names what a later pass, the cost model or a test reads back. The partitioner
copies node meta into the forward and backward graphs, so a key set on the joint graph is
there after partitioning.
"""

from __future__ import annotations

__all__ = [
    "AMAX",
    "BUCKET",
    "BYTES_BY_DTYPE",
    "CARRIES",
    "FLOAT8_SCALE",
    "MEMBERS",
    "PARAM_ID",
    "PREFETCH",
    "UNPACKED",
]

PARAM_ID = "mfsdp_param_id"
"""The ``param_id`` (``ParamPlan``) a node of a lowered marker's chain, or of a flat's copies,
belongs to (``lower_collectives``): it moves with that parameter's collective."""

BUCKET = "mfsdp_bucket"
"""The plan bucket's index of a parameter collective, its wait, and a bucket's copies
(``bucket_collectives``)."""

MEMBERS = "mfsdp_members"
"""On a parameter collective: the ``param_id`` of each parameter it moves, in buffer order."""

UNPACKED = "mfsdp_unpacked"
"""On a member's read of a gathered bucket or flat: that member's ``param_id``."""

CARRIES = "mfsdp_carries"
"""On a gather: the dtype its bytes stand for (float8 travels as uint8)."""

BYTES_BY_DTYPE = "mfsdp_bytes_by_dtype"
"""On a merged gather: its members' bytes by dtype."""

FLOAT8_SCALE = "mfsdp_float8_scale"
"""True on a node of a float8 weight's scale chain: it moves with the gather it scales."""

AMAX = "mfsdp_amax"
"""True on a float8 weight's amax all-reduce, which a bucket merges with its others."""

PREFETCH = "mfsdp_prefetch"
"""``GraphModule.meta``: the prefetch distance each bucket got (``schedule_collectives``)."""
