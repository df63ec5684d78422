"""Model sizes the benches share, as ``TransformerConfig``s of ``fsdp_compile.models.Transformer``.

``tiny`` and ``small`` run on a CPU in seconds; ``500m`` and ``1b`` are Llama-style shapes
(head dim 64 or 128, SwiGLU hidden about 2.7x or 4x dim, 32000 tokens) for GPUs. Parameter counts
include the tied embedding once and the frozen positional table.
"""

from __future__ import annotations

from fsdp_compile.models import TransformerConfig

PRESETS: dict[str, TransformerConfig] = {
    # 1.9 M parameters.
    "tiny": TransformerConfig(vocab=1024, dim=256, n_layers=2, n_heads=4, hidden=704, max_seq=256),
    # 17.3 M parameters.
    "small": TransformerConfig(
        vocab=8192, dim=512, n_layers=4, n_heads=8, hidden=1408, max_seq=512
    ),
    # 503.8 M parameters.
    "500m": TransformerConfig(
        vocab=32000, dim=1536, n_layers=16, n_heads=12, hidden=4096, max_seq=1024
    ),
    # 1.14 B parameters (Llama 3.2 1B's dim, depth, heads and MLP, without grouped KV heads).
    "1b": TransformerConfig(
        vocab=32000, dim=2048, n_layers=16, n_heads=32, hidden=8192, max_seq=2048
    ),
}
