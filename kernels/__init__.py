"""Triton kernels for multi-adapter prefill work, each beside its torch reference.

- :mod:`preft.kernels.lora_tiles`: segmented LoRA shrink/expand over a step's tile plan, fused
  gather-GEMM-scatter (reference: :func:`preft.serving.lora_ops.planned_lora_linear`);
- :mod:`preft.kernels.reft_tiles`: the ReFT-P edit of one layer in one launch (reference:
  :func:`preft.serving.reft.reft_edit`); the ReFT-P bank runs it on CUDA.

Nothing here is imported on CPU outside the tests (which run Triton's interpreter).
"""
