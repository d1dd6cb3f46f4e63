"""The fast CPU step (preft.trainers.cpu_step): the same loss, gradients and training, less work."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from trl import SFTConfig

import preft
from preft.models import larger_random_llama
from preft.trainers import PreftSFTTrainer, cpu_step


def attention_by_hand(query, key, value, causal: bool):
    """softmax(q k^T / sqrt(d)) v in float64, written out (the reference shares no code with SDPA)."""
    q, k, v = (t.double() for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return scores.softmax(-1) @ v


class Attention(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 1


@pytest.mark.parametrize("tokens", [63, cpu_step.FLOAT32_ATTENTION_MAX_KEYS + 1])
def test_cpu_sdpa_is_float32_for_short_rows_and_sdpa_for_long_ones(tokens):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 3, tokens, 16, dtype=torch.bfloat16) for _ in range(3))
    got, _ = cpu_step.cpu_sdpa(Attention(), query, key, value, None)
    assert got.dtype == torch.bfloat16
    exact = attention_by_hand(query, key, value, causal=True).transpose(1, 2)  # transformers' [B, T, H, D]
    bf16, _ = sdpa_attention_forward(Attention(), query, key, value, None)
    if tokens <= cpu_step.FLOAT32_ATTENTION_MAX_KEYS:
        # float32 arithmetic, one rounding to bf16 at the end: within half a bf16 step of the exact value
        assert (got.double() - exact).abs().max() <= (exact.abs().max() * 2 ** -8).item()
        assert not torch.equal(got, bf16)  # and not what bf16 arithmetic gives
    else:
        assert torch.equal(got, bf16)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_a_model_on_cpu_sdpa_masks_padding_as_sdpa_does(padding_side):
    """Padded rows: the same logits at real positions as the model on SDPA (float32, where
    cpu_sdpa is SDPA itself, so any difference is the mask)."""
    torch.manual_seed(0)
    model = larger_random_llama(vocab_size=64).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 64, (2, 12))
    mask = torch.ones_like(ids)
    pad = slice(0, 5) if padding_side == "left" else slice(7, 12)
    mask[1, pad] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        assert cpu_step.use_cpu_sdpa(model)
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5, rtol=0)


def test_head_on_labelled_positions_scores_fewer_rows_for_the_same_loss_and_gradients():
    import trl.trainer.utils as trl_utils

    torch.manual_seed(0)
    model = larger_random_llama(300)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(0, 300, (3, 20))
    labels = ids.clone()
    labels[:, :14] = -100  # the head predicts position t+1 from t: six labelled positions a row
    labels[2, :] = -100
    labels[2, -3:] = ids[2, -3:]
    scored, apply = [], trl_utils._ChunkedLogProbFunction.apply

    def counting(hidden, *args):
        scored.append(hidden.shape[0])
        return apply(hidden, *args)

    results = []
    trl_utils._ChunkedLogProbFunction.apply = counting
    try:
        for fast in (False, True):
            model.zero_grad()
            with cpu_step.head_on_labelled_positions() if fast else torch.enable_grad():
                out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            loss = -out.log_probs.sum() / out.label_mask.sum()
            loss.backward()
            results.append((loss.detach(), out.entropy.detach(), out.is_top1,
                            model.model.layers[0].mlp.down_proj.weight.grad.clone()))
    finally:
        trl_utils._ChunkedLogProbFunction.apply = apply
    assert scored == [3 * 19, 6 + 6 + 3]
    assert trl_utils._use_triton(torch.device("cpu")) is False  # restored after the block
    for every, labelled in zip(*results):
        if labelled.dtype == torch.bool:
            assert torch.equal(every, labelled)
        else:
            torch.testing.assert_close(labelled, every, rtol=1e-5, atol=1e-6)


def sft_trainer(tmp_path, name, fast_cpu_step, peft_config=None, **args):
    rows = preft.data.user_examples(0, 24)
    config = SFTConfig(output_dir=str(tmp_path / name), report_to="none", use_cpu=True, max_steps=3,
                       per_device_train_batch_size=8, logging_steps=1, learning_rate=1e-2, seed=0, **args)
    return PreftSFTTrainer(model=preft.DEFAULT_BASE_MODEL, args=config, train_dataset=Dataset.from_list(rows),
                           peft_config=peft_config or preft.PreftLoraConfig(r=8, target_modules="all-linear"),
                           fast_cpu_step=fast_cpu_step)


def losses(trainer) -> list[float]:
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_fast_cpu_step_trains_as_trls_own_step_in_float32(tmp_path):
    trl_step = sft_trainer(tmp_path, "trl", fast_cpu_step=False, bf16=False)
    fast = sft_trainer(tmp_path, "fast", fast_cpu_step=True, bf16=False)
    assert trl_step.model.get_base_model().config._attn_implementation == "sdpa"
    assert fast.model.get_base_model().config._attn_implementation == cpu_step.CPU_SDPA
    expected, got = losses(trl_step), losses(fast)
    assert len(got) == 3 and got[-1] < got[0]
    assert got == pytest.approx(expected, rel=1e-4)


def test_fast_cpu_step_under_bf16_autocast_with_gradient_checkpointing(tmp_path):
    """The adapter's input casts stay off through the backward's recompute, and are back after the step."""
    trl_step = sft_trainer(tmp_path, "trl", fast_cpu_step=False, bf16=True, gradient_checkpointing=True)
    fast = sft_trainer(tmp_path, "fast", fast_cpu_step=True, bf16=True, gradient_checkpointing=True)
    expected, got = losses(trl_step), losses(fast)
    assert got == pytest.approx(expected, rel=0.02)  # bf16 rounding differs where the casts are
    layers = [m for m in fast.model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and all(m.cast_input_dtype_enabled for m in layers)


def test_fast_cpu_step_under_bf16_autocast_trains_a_reft_p_adapter(tmp_path):
    """The fast step's input-cast switch covers ReFT-P layers too (the tour trains a LoReFT-P user)."""
    reft = lambda: preft.PreftReftConfig(rank=4, layers=[0, 2])  # noqa: E731
    expected = losses(sft_trainer(tmp_path, "trl", fast_cpu_step=False, peft_config=reft(), bf16=True))
    got = losses(sft_trainer(tmp_path, "fast", fast_cpu_step=True, peft_config=reft(), bf16=True))
    assert len(got) == 3 and got == pytest.approx(expected, rel=0.02)
