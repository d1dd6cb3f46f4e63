"""``PreftSFTTrainer``: TRL's SFTTrainer for prefill-only adapters."""

from __future__ import annotations

import contextlib

from trl import SFTConfig, SFTTrainer

from preft.context import prompt_lengths_from_labels
from preft.trainers import cpu_step
from preft.trainers.checkpoints import OwnCheckpointRotation
from preft.trainers.checks import check_dataset, check_model_path, load_as_served, is_prefill_only, peft_config_of


class PreftSFTTrainer(OwnCheckpointRotation, SFTTrainer):
    """SFT where the adapter sees prompt tokens only: ``P`` = position of the first completion label.

    Accepts prompt/completion data sets, plain text or conversational (TRL formats); the loss is
    on completion tokens only, and every forward gets explicit per-row ``prompt_lengths``, so the
    mask holds on every TRL loss path (fused head, label smoothing, custom loss functions).
    Works with ``PreftLoraConfig``, ``PreftReftConfig`` and plain ``peft.LoraConfig`` (baseline).
    On a CPU the step skips work TRL and transformers do there for nothing
    (:mod:`preft.trainers.cpu_step`; ``fast_cpu_step=False`` keeps their own path).

    Example::

        >>> import preft
        >>> from datasets import Dataset
        >>> from trl import SFTConfig
        >>> from preft import PreftSFTTrainer
        >>> data = Dataset.from_list(preft.data.user_examples(user=0, n=64))
        >>> trainer = PreftSFTTrainer(model=preft.DEFAULT_BASE_MODEL, train_dataset=data,
        ...     args=SFTConfig(output_dir="runs/x", max_steps=3, report_to="none"),
        ...     peft_config=preft.PreftLoraConfig(r=8))  # doctest: +SKIP
    """

    def __init__(self, model, args: SFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 peft_config=None, fast_cpu_step: bool = True, **kwargs):
        args = args if args is not None else SFTConfig(output_dir="runs/preft-sft")
        if args.packing or args.padding_free:
            raise ValueError(
                "packing / padding_free put several sequences in one row, but PreFT needs one prompt "
                "length per row: set packing=False and padding_free=False"
            )
        if args.completion_only_loss is False:
            raise ValueError(
                "completion_only_loss=False trains on prompt tokens and hides where the prompt ends; "
                "PreFT needs completion-only loss (leave it None or True)"
            )
        if args.assistant_only_loss:
            raise ValueError("assistant_only_loss is not supported: use prompt/completion data sets")
        check_model_path(model)
        load_as_served(model, args)
        self.preft_config = peft_config_of(model, peft_config)
        check_dataset(train_dataset, ("prompt", "completion"), "train_dataset")
        eval_sets = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        for eval_set in eval_sets:
            check_dataset(eval_set, ("prompt", "completion"), "eval_dataset")
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         peft_config=peft_config, **kwargs)
        self.fast_cpu_step = fast_cpu_step and self.args.device.type == "cpu"
        if self.fast_cpu_step:
            cpu_step.use_cpu_sdpa(self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if is_prefill_only(self.preft_config) and "labels" in inputs:
            inputs["prompt_lengths"] = prompt_lengths_from_labels(inputs["labels"], inputs.get("attention_mask"))
        with cpu_step.head_on_labelled_positions() if self.fast_cpu_step else contextlib.nullcontext():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # around the backward too: gradient checkpointing recomputes the forward there
        autocast = self.fast_cpu_step and (self.args.bf16 or self.args.fp16)
        with cpu_step.no_adapter_input_casts(model, autocast=autocast):
            return super().training_step(model, inputs, num_items_in_batch)
