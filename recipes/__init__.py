"""Single-file recipes (torchtune style), their YAML configs, and the PreFT TRL trainers.

Run a recipe with ``preft train recipes/configs/NAME.yaml [key=value ...]``.
"""

import warnings

# TRL warns at import that it was tested against older vLLM releases. PreFT never uses TRL's
# vLLM integration (PreftGRPOTrainer refuses use_vllm=True), so the warning is noise here.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
