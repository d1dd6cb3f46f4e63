"""Base models the project builds itself (nothing comes from a model hub)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def random_llama(vocab_size: int, hidden_size: int, num_layers: int, heads: int, kv_heads: int,
                 intermediate_size: int, seed: int = 0) -> LlamaForCausalLM:
    """A random-init Llama of the given shape (float32, 512 positions), the same for the same seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config)


def larger_random_llama(vocab_size: int) -> LlamaForCausalLM:
    """A random-init Llama of 27M parameters (hidden 512 x 8 layers, 8 heads, 2 KV heads): big
    enough that an adapter's matmuls and a prefill's cost show in the benchmarks ("512x8")."""
    return random_llama(vocab_size, hidden_size=512, num_layers=8, heads=8, kv_heads=2, intermediate_size=1408)
