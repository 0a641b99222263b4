"""Model shapes the benchmarks use: (name, tokens N, hidden H, vocab V)."""
S1 = ("S1 (Qwen-like student)", 8192, 2048, 151_936)
QWEN3_06B = ("Qwen3-0.6B-like", 16384, 1024, 151_936)
LLAMA3_8B = ("Llama-3-8B-like", 8192, 4096, 128_256)
STUDENT_SHAPES = (S1, QWEN3_06B, LLAMA3_8B)
TEACHER_SHAPES = (("teacher Qwen-like", 8192, 4096, 151_936), ("teacher Llama-like", 16384, 4096, 128_256))
