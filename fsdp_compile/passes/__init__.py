"""One module per pass; each is ``(gm, plan) -> gm`` and states its invariant in its docstring.

Order (see ``fsdp_compile.pipeline.build_pipeline``):
  Dynamo graph:  dedupe_unshards
  joint graph:   lower_collectives -> reshard -> (min-cut partition)
"""

from fsdp_compile.passes.dedupe_unshards import check_dedupe_unshards, dedupe_unshards
from fsdp_compile.passes.lower_collectives import check_lower_collectives, lower_collectives
from fsdp_compile.passes.reshard import check_reshard, reshard, saved_gathered_params

__all__ = [
    "dedupe_unshards",
    "check_dedupe_unshards",
    "lower_collectives",
    "check_lower_collectives",
    "reshard",
    "check_reshard",
    "saved_gathered_params",
]
