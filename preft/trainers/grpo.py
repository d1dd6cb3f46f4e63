"""``PreftGRPOTrainer``: TRL's GRPOTrainer for prefill-only adapters, on-policy."""

from __future__ import annotations

from trl import GRPOConfig, GRPOTrainer

from preft.trainers.checkpoints import OwnCheckpointRotation
from preft.trainers.checks import check_dataset, check_model_path, load_as_served, peft_config_of


class PreftGRPOTrainer(OwnCheckpointRotation, GRPOTrainer):
    """GRPO whose rollouts and log-probs both apply the adapter to prompt tokens only.

    - Rollouts use HF ``generate`` on the PEFT model: the prefill forward runs the adapter, every
      decode step the base model (``preft.context``), so completions come from the policy.
    - Log-probs for the loss, the old policy and the reference model go through TRL's
      ``labels``-based forward, where ``labels[:, :-logits_to_keep] = -100``: the prompt width is
      ``input_ids.size(1) - logits_to_keep`` and ``P`` per row is its real (non-pad) length.
      The reference model is the base model (adapter disabled), as TRL does for PEFT.
    - ``use_vllm=True`` is refused: TRL's vLLM rollout merges the adapter into the weights, which
      would apply a prefill-only adapter to generated tokens too (off-policy samples).

    Reward functions are plain Python callables, as in TRL.
    """

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, peft_config=None, **kwargs):
        args = args if args is not None else GRPOConfig(output_dir="runs/preft-grpo")
        if args.use_vllm:
            raise ValueError(
                "use_vllm=True is not supported for PreFT: TRL's vLLM rollout merges the adapter into "
                "the weights, so generated tokens would see it too. Leave use_vllm=False (HF generation)."
            )
        check_model_path(model)
        load_as_served(model, args)
        self.preft_config = peft_config_of(model, peft_config)
        check_dataset(train_dataset, ("prompt",), "train_dataset")
        check_dataset(eval_dataset, ("prompt",), "eval_dataset")
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, peft_config=peft_config, **kwargs)
