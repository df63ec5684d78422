"""One module per pass; each is ``(gm, plan) -> gm`` and states its invariant in its docstring.

Order (see ``fsdp_compile.pipeline.build_pipeline``):
  Dynamo graph:  (check_graph_breaks, only with options["cuda_graph"])
                 -> drop_block_probes -> dedupe_unshards -> check_rank_agreement
  joint graph:   constant_opaque_outputs -> lower_collectives -> pack_in_reduce_dtype -> reshard
                 -> save_block_rng
                 -> (min-cut partition)
  partitioned:   replay_block_rng -> keep_only_differentiated_calls -> bucket_collectives -> copy_out_flats
                 -> separate_gradient_outputs -> schedule_collectives (forward and backward)
                 -> check_cuda_graph (only with options["cuda_graph"])
"""

from fsdp_compile.passes.bucket_collectives import bucket_collectives, check_bucket_collectives
from fsdp_compile.passes.check_cuda_graph import CudaGraphIncompatible, check_cuda_graph
from fsdp_compile.passes.check_graph_breaks import GraphBreakUnderCudaGraph, check_graph_breaks
from fsdp_compile.passes.check_rank_agreement import check_rank_agreement, collective_fingerprint
from fsdp_compile.passes.copy_out_flats import check_copy_out_flats, copy_out_flats
from fsdp_compile.passes.constant_opaque_outputs import (
    check_constant_opaque_outputs,
    constant_opaque_outputs,
)
from fsdp_compile.passes.drop_block_probes import check_drop_block_probes, drop_block_probes
from fsdp_compile.passes.dedupe_unshards import check_dedupe_unshards, dedupe_unshards
from fsdp_compile.passes.keep_only_differentiated_calls import (
    check_keep_only_differentiated_calls,
    keep_only_differentiated_calls,
)
from fsdp_compile.passes.lower_collectives import check_lower_collectives, lower_collectives
from fsdp_compile.passes.pack_in_reduce_dtype import check_pack_in_reduce_dtype, pack_in_reduce_dtype
from fsdp_compile.passes.replay_block_rng import check_replay_block_rng, replay_block_rng
from fsdp_compile.passes.reshard import check_reshard, reshard, saved_gathered_params
from fsdp_compile.passes.save_block_rng import check_save_block_rng, save_block_rng
from fsdp_compile.passes.separate_gradient_outputs import check_separate_gradient_outputs, separate_gradient_outputs
from fsdp_compile.passes.schedule_collectives import (
    CollectiveGroup,
    GatherLifetime,
    collective_groups,
    check_schedule_collectives,
    gather_lifetimes,
    ranked_gathers,
    peak_inflight_bytes,
    schedule_collectives,
)

__all__ = [
    "check_rank_agreement",
    "collective_fingerprint",
    "check_cuda_graph",
    "CudaGraphIncompatible",
    "check_graph_breaks",
    "GraphBreakUnderCudaGraph",
    "drop_block_probes",
    "check_drop_block_probes",
    "dedupe_unshards",
    "check_dedupe_unshards",
    "constant_opaque_outputs",
    "check_constant_opaque_outputs",
    "lower_collectives",
    "check_lower_collectives",
    "pack_in_reduce_dtype",
    "check_pack_in_reduce_dtype",
    "reshard",
    "check_reshard",
    "saved_gathered_params",
    "save_block_rng",
    "check_save_block_rng",
    "replay_block_rng",
    "check_replay_block_rng",
    "keep_only_differentiated_calls",
    "check_keep_only_differentiated_calls",
    "bucket_collectives",
    "check_bucket_collectives",
    "copy_out_flats",
    "check_copy_out_flats",
    "separate_gradient_outputs",
    "check_separate_gradient_outputs",
    "schedule_collectives",
    "check_schedule_collectives",
    "gather_lifetimes",
    "ranked_gathers",
    "GatherLifetime",
    "peak_inflight_bytes",
    "collective_groups",
    "CollectiveGroup",
]
