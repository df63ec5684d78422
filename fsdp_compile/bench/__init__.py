"""Benchmarks.

``python -m fsdp_compile.bench`` (console script ``mfsdp-bench``): eager vs FSDP2 vs mfsdp
(vs mfsdp + CUDA graph on GPUs) on shared presets. ``python -m fsdp_compile.bench.cuda_graph``:
the GPU-only eager vs compiled vs captured step. Results: docs/performance.md.
"""
