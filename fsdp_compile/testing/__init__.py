"""Models for tests, benchmarks and examples (``fsdp_compile.testing.models``).

Nothing the backend runs imports this package: it is the test transformer (with the fused
``autograd.Function`` linears and MoE blocks the suite needs), its batches and its training
step, shipped so that the examples and ``mfsdp-bench`` work from an installed copy.
"""
