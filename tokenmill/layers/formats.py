"""The weight formats the CPU kernels take: GGUF's block sizes and the kernels' format ids.

Imports nothing of tokenmill, so that the kernels' loader (layers/kernels.py), the quantized layers
(layers/quant.py) and the panel layouts (layers/panels.py) can all name the formats without importing
each other. The layouts themselves are described in quant.py (rows of blocks) and panels.py (panels of 8
rows), and at the top of csrc/cpu_kernels.cpp and csrc/panels_x8.h.
"""

from __future__ import annotations

QK = 32  # weights in a block
QK_K = 256  # a K-quant super-block
BLOCK_WEIGHTS = {"q8_0": QK, "q4_1": QK, "q5_0": QK, "q4_k": QK_K, "q5_k": QK_K, "q6_k": QK_K}
BLOCK_BYTES = {"q8_0": 34, "q4_1": 20, "q5_0": 22, "q4_k": 144, "q5_k": 176, "q6_k": 210}  # per block
# the kernel's fmt argument: the row formats, then Q4_K, Q6_K, Q4_1 and Q5_K in panels of 8 rows (layers/panels.py)
FORMAT_IDS = {"q8_0": 0, "q4_1": 1, "q5_0": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5, "q4_k_x8": 6, "q6_k_x8": 7,
              "q4_1_x8": 8, "q5_k_x8": 9}
