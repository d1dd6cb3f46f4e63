"""The PreFT trainers: thin TRL subclasses that give every forward its rows' prompt lengths.

>>> from preft.trainers import PreftSFTTrainer, PreftGRPOTrainer   # also: from preft import ...

- :class:`PreftSFTTrainer` (``trl.SFTTrainer``): ``P`` = position of the first completion label;
- :class:`PreftGRPOTrainer` (``trl.GRPOTrainer``): rollouts with HF ``generate`` (adapter on the
  prompt only), log-probs through TRL's labels-based forward.

Input checks shared by both are in :mod:`preft.trainers.checks`. The single-file recipes that
use them are in ``recipes/`` (``preft train recipes/configs/NAME.yaml``).
"""

import warnings

# TRL warns at import that it was tested against older vLLM releases. PreFT never uses TRL's
# vLLM integration (PreftGRPOTrainer refuses use_vllm=True), so the warning is noise here.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")

from preft.trainers.grpo import PreftGRPOTrainer  # noqa: E402
from preft.trainers.sft import PreftSFTTrainer  # noqa: E402

__all__ = ["PreftGRPOTrainer", "PreftSFTTrainer"]
