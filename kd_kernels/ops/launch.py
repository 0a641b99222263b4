"""Launch configurations of the Triton kernels, in one place (no autotuning by default)."""
import os

# Columns per step of the row-streaming kernels; small under the CPU interpreter.
ROW_BLOCK_V = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 4096


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 256))
