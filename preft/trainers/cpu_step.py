"""A fast SFT step on a CPU: three costs TRL, transformers and PEFT leave there, each removed exactly.

A step is the forward and backward of B rows of T tokens, then the head and loss over the L
labelled (completion) positions, L well below B*T. On SmolLM2-135M (vocabulary V = 49,152,
hidden H = 576) with 8 chat rows (B*T = 8*63, L = 150) on two cores
(``preft bench sft-step --model smollm2-135m-instruct``, docs/RESULTS.md):

1. **The head on labelled positions only.** TRL's fused head (``add_fused_lm_head``) scores the
   labelled positions on Triton devices but every position elsewhere, so that a compiling
   device (Neuron) meets one tile shape: ``B*T*V*H`` multiply-adds and ``B*T*V`` softmax terms,
   forward and backward, where ``L*V*H`` would do. A CPU compiles nothing, so
   :func:`head_on_labelled_positions` has TRL take its compact path there; the loss and the
   logged metrics are the same sums over the same positions. This was 43% of a bf16 step.
2. **Short rows attend in float32.** PyTorch's CPU flash attention in bfloat16 has a large
   fixed cost: forward and backward of a [8, 9, 63, 64] batch take 13.6 ms in bf16 and 4.4 ms in
   float32, [4, 9, 256, 64] 19.5 against 16.6 ms; from about 1,024 tokens bf16 is faster (29
   against 40 ms). :func:`cpu_sdpa` (the ``preft_cpu_sdpa`` attention, transformers'
   ``AttentionInterface``) computes attention over at most ``FLOAT32_ATTENTION_MAX_KEYS`` keys in
   float32, the rest as transformers' SDPA does; float32 is the more precise of the two.
3. **No adapter input casts under autocast.** PEFT casts each LoRA layer's input to the
   adapter's float32 and autocast casts it back to bf16 for the matmul: two copies of every
   adapted activation per layer for the same bf16 product. Under autocast
   :func:`no_adapter_input_casts` leaves the input as it is (``peft.helpers.disable_input_dtype_casting``).

:class:`preft.trainers.PreftSFTTrainer` applies all three when it trains on a CPU
(``fast_cpu_step=False`` keeps TRL's own path, as the benchmark's baseline does).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

#: Keys up to which a CPU computes bf16/fp16 attention in float32 (measured faster up to 256).
FLOAT32_ATTENTION_MAX_KEYS = 256

CPU_SDPA = "preft_cpu_sdpa"


def cpu_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, in float32 for half-precision rows of few keys on a CPU."""
    short = key.shape[-2] <= FLOAT32_ATTENTION_MAX_KEYS
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16) or not short:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                                 attention_mask, **kwargs)
    return output.to(query.dtype), weights


AttentionInterface.register(CPU_SDPA, cpu_sdpa)
# An attention transformers' masks do not know gets no mask at all (padding would be attended):
# this one takes the masks SDPA takes.
AttentionMaskInterface.register(CPU_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_cpu_sdpa(model) -> bool:
    """Switch a model that computes transformers' SDPA attention to :func:`cpu_sdpa`; a model
    loaded with any other attention (eager for Gemma 2's soft-capping, a kernel) keeps it."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    model.set_attn_implementation(CPU_SDPA)
    return True


@contextlib.contextmanager
def head_on_labelled_positions():
    """TRL's fused head scores only the labelled positions on a CPU too, for the ``with`` block."""
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:
        raise RuntimeError("trl.trainer.utils._use_triton moved: update preft.trainers.cpu_step for this TRL release")
    # Only the choice of positions reads this name here; the kernels module keeps its own
    # binding, so the tiles are still folded by TRL's torch code on a CPU.
    trl_utils._use_triton = lambda device: device.type == "cpu" or original(device)
    try:
        yield
    finally:
        trl_utils._use_triton = original


def no_adapter_input_casts(model, autocast: bool):
    """PEFT's input casts off for the ``with`` block when ``autocast`` is on (else a no-op)."""
    if not autocast:
        return contextlib.nullcontext()
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(model, active=True)
