"""Benchmarks.

``python -m fsdp_compile.bench`` (console script ``mfsdp-bench``): eager, FSDP2, FSDP2 +
per-block compile, mfsdp (one body per block or the whole graph) and, on GPUs, mfsdp + one
CUDA graph, on shared presets (this project's Transformer and HF models), for a real job or
one rank of a fake one. ``python -m fsdp_compile.bench.summary`` puts several runs in one
table of ratios (``benchmarks/gpu_rows.sh``). Results: docs/performance.md.
"""
