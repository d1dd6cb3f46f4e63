"""Configuration of prefill-only ReFT (LoReFT-P, DiReFT-P)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from peft import PeftConfig

PREFT_REFT = "PREFT_REFT"
INTERVENTIONS = ("loreft", "direft")


@dataclass
class PreftReftConfig(PeftConfig):
    """ReFT-P: a low-rank edit of the residual stream after chosen decoder layers, prompt tokens only.

    - ``intervention="loreft"``: ``h + R^T (W h + b - R h)``, ``R`` (rank x hidden) with orthonormal rows
    - ``intervention="direft"``: ``h + W2^T (W1 h + b)`` (no orthogonality)

    applied at absolute positions ``adapter_start <= p < P`` of the outputs of ``layers``
    (ReFT, arXiv 2404.03592; PreFT, arXiv 2605.14217).

    Example::

        >>> import preft
        >>> from peft import get_peft_model
        >>> from transformers import AutoModelForCausalLM
        >>> base = AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL)
        >>> model = get_peft_model(base, preft.PreftReftConfig(rank=4, layers=[1, 3]))
        >>> model.peft_config["default"].peft_type
        'PREFT_REFT'
    """

    rank: int = field(default=4, metadata={"help": "Rank r of the intervention subspace."})
    layers: Optional[list[int]] = field(
        default=None,
        metadata={"help": "Indices of the decoder layers whose outputs are edited; None = all."},
    )
    intervention: str = field(
        default="loreft", metadata={"help": f"Intervention formula, one of {INTERVENTIONS}."}
    )
    dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the hidden state fed to the intervention."}
    )
    adapter_start: int = field(
        default=0,
        metadata={"help": "First absolute token position edited; active at "
                          "adapter_start <= p < prompt length."},
    )
    prefill_only: bool = field(
        default=True,
        metadata={"help": "True: prompt tokens only (PreFT). False: every token (standard ReFT), "
                          "the baseline the eval harness compares."},
    )
    init_weights: bool = field(
        default=True,
        metadata={"help": "True: start as the identity (LoReFT W = R, b = 0; DiReFT W2 = 0), as PEFT "
                          "initialises LoRA. False: random (pyreft's default; useful in tests)."},
    )

    target_modules: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Filled in when the model is built: module names of the decoder layers "
                          "that `layers` selects. Not set by hand."},
    )

    def __post_init__(self):
        if self.peft_type not in (None, PREFT_REFT):
            raise ValueError(
                f"PreftReftConfig.peft_type must be {PREFT_REFT!r} (or unset), got {self.peft_type!r}"
            )
        super().__post_init__()
        self.peft_type = PREFT_REFT
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"PreftReftConfig.rank must be a positive integer, got {self.rank!r}")
        if self.intervention not in INTERVENTIONS:
            raise ValueError(
                f"PreftReftConfig.intervention must be one of {INTERVENTIONS}, got {self.intervention!r}"
            )
        if self.layers is not None:
            if isinstance(self.layers, int):
                self.layers = [self.layers]
            self.layers = list(self.layers)
            if not self.layers or any(not isinstance(i, int) or i < 0 for i in self.layers):
                raise ValueError(
                    f"PreftReftConfig.layers must be a non-empty list of layer indices >= 0 (or None "
                    f"for all layers), got {self.layers!r}"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"PreftReftConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.adapter_start, int) or self.adapter_start < 0:
            raise ValueError(
                f"PreftReftConfig.adapter_start must be an integer >= 0, got {self.adapter_start!r}"
            )
