"""Fused ops: each file holds a kernel, its launcher and the fp32 torch reference."""
