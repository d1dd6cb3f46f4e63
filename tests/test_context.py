"""Unit tests of the prefill context: positions and prompt lengths per row."""

from __future__ import annotations

import pytest
import torch

from preft.context import PrefillContext, PrefillTracker


def context_for(**kwargs) -> PrefillContext:
    tracker = PrefillTracker()
    tracker._before_forward(None, (), kwargs)
    return tracker.current


def test_active_mask_rule():
    ctx = PrefillContext(positions=torch.arange(6)[None], prompt_lengths=torch.tensor([4]))
    assert ctx.active_mask(0).tolist() == [[True, True, True, True, False, False]]
    assert ctx.active_mask(2).tolist() == [[False, False, True, True, False, False]]
    assert ctx.active_mask(9).tolist() == [[False] * 6]


def test_left_padding_positions_from_attention_mask():
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ctx = context_for(input_ids=ids, attention_mask=mask)
    assert ctx.positions[0, 2:].tolist() == [0, 1, 2]
    assert ctx.positions[1].tolist() == [0, 1, 2, 3, 4]
    assert ctx.prompt_lengths.tolist() == [3, 5]  # no labels: every real token is prompt


def test_prompt_length_from_labels_right_padded():
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, 7, 7, 7, -100], [-100, -100, -100, -100, -100, -100]])
    ctx = context_for(input_ids=ids, attention_mask=mask, labels=labels)
    assert ctx.prompt_lengths.tolist() == [2, 6]  # a row without completion is all prompt
    assert ctx.active_mask(0)[0].tolist() == [True, True, False, False, False, False]


def test_prompt_length_from_labels_left_padded():
    ids = torch.zeros(1, 6, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, -100, -100, 5, 5]])
    ctx = context_for(input_ids=ids, attention_mask=mask, labels=labels)
    assert ctx.prompt_lengths.tolist() == [2]


def test_explicit_prompt_lengths_are_checked():
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert context_for(input_ids=ids, prompt_lengths=3).prompt_lengths.tolist() == [3, 3]
    with pytest.raises(ValueError, match="prompt_lengths has 3 entries but the batch has 2"):
        context_for(input_ids=ids, prompt_lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="prompt_lengths must be >= 0"):
        context_for(input_ids=ids, prompt_lengths=[-1, 2])
