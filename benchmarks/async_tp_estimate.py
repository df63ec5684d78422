"""What async tensor parallelism would save, by the simulator (docs/design.md, "Async tensor
parallelism: the next step"): HF Llama-3 8B at dp 4 x tp 2 in one NVLink node, 70B at
dp 8 x tp 8 with "tp" on NVLink inside each node and "dp" on InfiniBand across nodes.

    python benchmarks/async_tp_estimate.py                           # both shapes, every layer
    python benchmarks/async_tp_estimate.py --shapes 8b --layers 2    # quicker: 2 layers

Each shape is traced once on the fake process group and the meta device (no weights, no
data): HF ``LlamaForCausalLM`` split with sequence parallelism as torchtitan splits Llama
(``fsdp_compile.testing.tensor_parallel``), one ``fully_shard`` per layer then the root over
"dp", bf16 compute and fp32 reduction, 2 sequences of 4096 tokens per data-parallel rank.
``estimate_async_tp`` then plays the compiled graphs (NOTE: the async TP estimate, in
fsdp_compile/async_tp_estimate.py). Prints a markdown table and one JSON line per shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

import torch

from fsdp_compile.async_tp_estimate import AsyncTensorParallelEstimate, estimate_async_tp
from fsdp_compile.cost_model import NVLINK_GPU, Hardware
from fsdp_compile.simulate import INFINIBAND_GPU


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One shape on one layout: what is traced, and the links its groups cross."""

    llama: dict
    """``transformers.LlamaConfig`` fields (Llama 3's published shapes)."""
    dp: int
    tp: int
    data_parallel_link: Hardware
    tensor_parallel_link: Hardware
    batch: int = 2
    seq: int = 4096


_LLAMA3 = dict(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
LAYOUTS = {
    # 8 GPUs, one node: both groups on its NVLink, taking turns (estimate_timeline).
    "8b": Layout(
        llama=dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
        dp=4, tp=2, data_parallel_link=NVLINK_GPU, tensor_parallel_link=NVLINK_GPU,
    ),
    # 64 GPUs, 8 nodes: "tp" inside a node, "dp" across nodes.
    "70b": Layout(
        llama=dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
        dp=8, tp=8, data_parallel_link=INFINIBAND_GPU, tensor_parallel_link=NVLINK_GPU,
    ),
}


def estimate(layout: Layout) -> AsyncTensorParallelEstimate:
    """Trace one training step of ``layout`` on the fake process group and estimate it."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile import MfsdpBackend, MixedPrecision, fully_shard
    from fsdp_compile.testing.tensor_parallel import hf_llama_sequence_parallel

    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.dp * layout.tp)
    try:  # estimated inside: an all-reduce's group size is read from its live group
        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**layout.llama, use_cache=False))
        hf_llama_sequence_parallel(model.train(), mesh["tp"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=bf16)
        fully_shard(model, mesh=mesh["dp"], mp_policy=bf16)
        backend = MfsdpBackend(compiler="eager")
        tokens = torch.zeros(layout.batch, layout.seq, dtype=torch.long, device="meta")
        torch._dynamo.reset()
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            torch.compile(model, backend=backend)(tokens)
        links = {mesh["tp"].get_group().group_name: layout.tensor_parallel_link}
        return estimate_async_tp(backend.graphs, layout.data_parallel_link, links)
    finally:
        dist.destroy_process_group()


def _row(name: str, layout: Layout, e: AsyncTensorParallelEstimate) -> dict:
    return {
        "shape": name, "dp": layout.dp, "tp": layout.tp, "layers": layout.llama["num_hidden_layers"],
        "dp_link": layout.data_parallel_link.name, "tp_link": layout.tensor_parallel_link.name,
        "step_ms": e.step_seconds * 1e3, "exposed_ms": e.exposed_comm_seconds * 1e3,
        "exposed_tp_ms": e.exposed_tensor_parallel_seconds * 1e3,
        "tp_collectives": e.collectives, "tp_collectives_ms": e.collective_seconds * 1e3,
        "decomposable": e.decomposable,
        "decomposable_ms": e.decomposable_seconds * 1e3,
        "saved_ms": e.saved_seconds * 1e3, "saved_pct": 100 * e.saved_seconds / e.step_seconds,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(LAYOUTS), help="comma-separated: 8b,70b")
    parser.add_argument("--layers", type=int, help="trace this many layers instead of the shape's")
    args = parser.parse_args(argv)
    rows = []
    for name in args.shapes.split(","):
        layout = LAYOUTS[name]
        if args.layers:
            layout = dataclasses.replace(layout, llama=dict(layout.llama, num_hidden_layers=args.layers))
        rows.append(_row(name, layout, estimate(layout)))
        print(json.dumps(rows[-1]))
    print("| shape | dp x tp | layers | step ms | exposed comm ms | of it tensor-parallel ms "
          "| TP collectives: ms | decomposable: ms | async TP saves ms |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['shape']} | {r['dp']} x {r['tp']} | {r['layers']} | {r['step_ms']:.1f} | {r['exposed_ms']:.1f} "
            f"| {r['exposed_tp_ms']:.1f} | {r['tp_collectives']}: {r['tp_collectives_ms']:.1f} "
            f"| {r['decomposable']}: {r['decomposable_ms']:.1f} "
            f"| {r['saved_ms']:.1f} ({r['saved_pct']:.1f}%) |"
        )


if __name__ == "__main__":
    main()
