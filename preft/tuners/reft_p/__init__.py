"""ReFT-P: LoReFT / DiReFT interventions on prompt (prefill) tokens only."""

from .config import INTERVENTIONS, PREFT_REFT, PreftReftConfig
from .layer import DiReFT, LoReFT, ReftLayer
from .model import PreftReftModel

__all__ = ["INTERVENTIONS", "PREFT_REFT", "PreftReftConfig", "DiReFT", "LoReFT", "ReftLayer", "PreftReftModel"]
