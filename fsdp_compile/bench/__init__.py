"""Benchmarks: ``python -m fsdp_compile.bench.cuda_graph`` (GPU) compares step modes."""
