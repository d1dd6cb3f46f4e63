"""Triton kernels for multi-adapter prefill work, each beside its torch reference.

- :mod:`preft.kernels.lora_tiles`: segmented LoRA shrink/expand over a step's tile plan, fused
  gather-GEMM-scatter (reference: :func:`preft.serving.lora_ops.planned_lora_linear`).
"""
