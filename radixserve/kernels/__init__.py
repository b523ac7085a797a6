"""C++ kernels for the CPU, compiled on first use with the machine's own compiler into one
library (build.py), and their Python faces, one module a family: paged attention
(attention.py), a decoder layer's small ops and the decoder stack (layer_ops.py), bfloat16
matmuls of a few rows (bf16_matmul.py), float32 matmuls on packed 16-bit panels
(float_panels.py), GGUF-quantized matmuls (gguf.py), and 2 MB-page buffers for packed weights
(arena.py); the paths each family runs on this CPU, as the library's one probe ranks them
(paths.py, csrc/common/cpu_features.cpp). This file is the package's interface: it re-exports their public names.

Each op has a PyTorch fallback: where the library cannot be built its getter returns None,
the build logs why once, and the engine keeps its PyTorch paths.
"""

from radixserve.kernels.arena import PanelArena, empty_on_huge_pages
from radixserve.kernels.attention import attention_path, attention_path_for, paged_attention_op
from radixserve.kernels.bf16_matmul import SKINNY_MAX_ROWS, skinny_matmul_op
from radixserve.kernels.float_panels import FloatPanelOps, float_panel_ops
from radixserve.kernels.gguf import GGUFOps, gguf_ops
from radixserve.kernels.layer_ops import (
    LayerOps,
    argmax_op,
    decoder_stack,
    kv_write_op,
    layer_ops,
    token_bitmask_op,
)
from radixserve.kernels.paths import best_path, cpu_features, path_names

__all__ = [
    "SKINNY_MAX_ROWS", "GGUFOps", "LayerOps", "PanelArena", "FloatPanelOps", "argmax_op",
    "attention_path", "attention_path_for", "best_path", "cpu_features", "decoder_stack",
    "empty_on_huge_pages", "gguf_ops", "kv_write_op", "layer_ops", "paged_attention_op",
    "path_names", "float_panel_ops", "skinny_matmul_op", "token_bitmask_op",
]
