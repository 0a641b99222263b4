"""Triton kernels, one per file: pure functions on tensors, no autograd, no validation.

Importing a module here imports Triton; nothing in the package imports them until a
Triton backend is asked for. Under TRITON_INTERPRET=1 they run on CPU (fp32 / fp16).
"""
