"""Base models the project builds itself (nothing comes from a model hub)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def larger_random_llama(vocab_size: int) -> LlamaForCausalLM:
    """A random-init Llama of 27M parameters (hidden 512 x 8 layers, 8 heads, 2 KV heads): big
    enough that an adapter's matmuls and a prefill's cost show in the benchmarks ("512x8")."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config)
