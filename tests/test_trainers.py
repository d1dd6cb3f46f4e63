"""TRL trainers and recipes for PreFT adapters: short real runs, parity, resume, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import PeftModel, PrefixTuningConfig
from trl import GRPOConfig, SFTConfig

import preft
from conftest import load_base
from test_distributed_training import free_port
from preft.cli import main as cli_main
from preft.trainers import PreftGRPOTrainer
from preft.trainers import PreftSFTTrainer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
TINY_SFT = ["data.train_examples=64", "data.eval_examples=16", "trainer.per_device_train_batch_size=4",
            "trainer.per_device_eval_batch_size=8", "trainer.logging_steps=1", "trainer.eval_steps=2"]
TINY_GRPO = ["data.train_prompts=32", "data.eval_prompts=8", "trainer.per_device_train_batch_size=8",
             "trainer.num_generations=4", "trainer.logging_steps=1", "trainer.report_to=none"]


def sft_trainer(tmp_path, peft_config, dataset=None, **args):
    dataset = dataset if dataset is not None else Dataset.from_list(preft.data.user_examples(0, 16))
    config = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False,
                       per_device_train_batch_size=4, max_steps=1, **args)
    return PreftSFTTrainer(model=preft.DEFAULT_BASE_MODEL, args=config, train_dataset=dataset,
                           peft_config=peft_config)


@pytest.mark.slow
def test_sft_recipe_three_steps_saves_a_loadable_adapter(tmp_path, base_path):
    out = tmp_path / "run"
    # report_to stays "wandb": offline by default
    assert cli_main(["train", str(CONFIGS / "sft_lora_p.yaml"), f"output_dir={out}",
                     "trainer.max_steps=3", "trainer.save_steps=3", *TINY_SFT]) == 0
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["wall_time_s"] > 0 and summary["config"]["adapter"]["type"] == "lora_p"
    assert (out / "checkpoint-3").is_dir() and any((out / "wandb").iterdir())
    model = PeftModel.from_pretrained(load_base(base_path), out / "adapter")
    assert model.active_peft_config.peft_type == preft.PREFT_LORA


@pytest.mark.slow
def test_grpo_recipe_two_steps(tmp_path, base_path):
    out = tmp_path / "run"
    assert cli_main(["train", str(CONFIGS / "grpo_lora_p.yaml"), f"output_dir={out}",
                     "trainer.max_steps=2", *TINY_GRPO]) == 0
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["reward_history"]) == 2
    assert 0.0 <= summary["heldout_greedy_accuracy_after"] <= 1.0
    model = PeftModel.from_pretrained(load_base(base_path), out / "adapter")
    assert model.active_peft_config.peft_type == preft.PREFT_LORA


@pytest.mark.slow
def test_resume_from_checkpoint_continues_the_step_count(tmp_path):
    out = tmp_path / "run"
    common = ["train", str(CONFIGS / "sft_lora.yaml"), f"output_dir={out}", "trainer.report_to=none",
              "trainer.save_steps=2", "trainer.eval_strategy='no'", *TINY_SFT]
    assert cli_main([*common, "trainer.max_steps=2"]) == 0
    assert (out / "checkpoint-2").is_dir()
    assert cli_main([*common, "trainer.max_steps=4", "resume_from_checkpoint=true"]) == 0
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 4
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4]


def test_sft_teacher_forcing_equals_prompt_kv_reference(tmp_path, adapter_kind):
    """Trainer forward == prompt through the adapted model, completion through the base model on
    top of the prompt's KV cache (float64, < 1e-5)."""
    from conftest import ADAPTER_CONFIGS

    trainer = sft_trainer(tmp_path, ADAPTER_CONFIGS[adapter_kind]())
    model = trainer.model.double().eval()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(model, dict(inputs), return_outputs=True)
        labels, nll = inputs["labels"], []
        for row in range(labels.shape[0]):
            real = inputs["attention_mask"][row].bool()
            ids = inputs["input_ids"][row][real][None]
            prompt_len = int((labels[row][real] != -100).int().argmax())
            prefill = model(input_ids=ids[:, :prompt_len], use_cache=True)
            with model.disable_adapter():
                rest = model(input_ids=ids[:, prompt_len:], past_key_values=prefill.past_key_values)
            reference = torch.cat([prefill.logits[:, -1:], rest.logits[:, :-1]], dim=1)[0]
            got = outputs.logits[row][real][prompt_len - 1:-1]  # logits predicting the completion
            assert torch.allclose(got, reference, atol=1e-5, rtol=0)
            nll.append(-reference.log_softmax(-1).gather(-1, ids[0, prompt_len:, None]))
    assert abs(loss.item() - torch.cat(nll).mean().item()) < 1e-5


def test_grpo_generation_and_logprob_paths_agree(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, max_steps=1,
                        per_device_train_batch_size=4, num_generations=4, max_completion_length=6)
    trainer = PreftGRPOTrainer(
        model=preft.DEFAULT_BASE_MODEL, reward_funcs=preft.data.exact_match_reward, args=config,
        train_dataset=Dataset.from_list(preft.data.arithmetic_prompts(8)),
        peft_config=preft.PreftLoraConfig(r=8, init_lora_weights=False),
    )
    model = trainer.model.eval()
    tokenizer = trainer.processing_class
    prompts = tokenizer(["add 3 9 =", "sub 17 4 =", "add 11 2 ="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**prompts, do_sample=True, temperature=1.0, max_new_tokens=6, min_new_tokens=6,
                             output_logits=True, return_dict_in_generate=True)
        completion = out.sequences[:, prompts["input_ids"].shape[1]:]
        gen_logps = torch.stack(out.logits, 1).log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)
        mask = torch.cat([prompts["attention_mask"], torch.ones_like(completion)], dim=1)
        train_logps, _, _ = trainer._get_per_token_logps_and_entropies(model, out.sequences, mask, completion.shape[1])
    assert torch.allclose(train_logps, gen_logps, atol=1e-4, rtol=0)
    # and the adapter is really on during the prompt: the base model scores them differently
    with torch.no_grad(), model.disable_adapter():
        base_logps, _, _ = trainer._get_per_token_logps_and_entropies(model, out.sequences, mask, completion.shape[1])
    assert not torch.allclose(base_logps, gen_logps, atol=1e-3)


# ----------------------------------------------------------------------------- bad input


def test_trainers_refuse_what_would_break_the_mask(tmp_path):
    with pytest.raises(ValueError, match="packing"):
        sft_trainer(tmp_path, preft.PreftLoraConfig(r=4), packing=True)
    with pytest.raises(ValueError, match="completion_only_loss"):
        sft_trainer(tmp_path, preft.PreftLoraConfig(r=4), completion_only_loss=False)
    with pytest.raises(ValueError, match="use_vllm"):
        PreftGRPOTrainer(model=preft.DEFAULT_BASE_MODEL, reward_funcs=preft.data.exact_match_reward,
                         args=GRPOConfig(output_dir=str(tmp_path / "g"), use_vllm=True, report_to="none",
                                         use_cpu=True, bf16=False),
                         train_dataset=Dataset.from_list(preft.data.arithmetic_prompts(4)),
                         peft_config=preft.PreftLoraConfig(r=4))
    with pytest.raises(ValueError, match="unsupported PEFT type 'PREFIX_TUNING'"):
        sft_trainer(tmp_path, PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "train_dataset is empty"),
        ([{"prompt": "rewrite a cat =", "answer": " a dog"}], r"missing column\(s\) \['completion'\]"),
        ([{"prompt": "rewrite a cat =", "completion": "  "}], "row 0 has a prompt with no completion"),
    ],
)
def test_bad_sft_datasets(tmp_path, rows, message):
    dataset = Dataset.from_list(rows) if rows else Dataset.from_dict({"prompt": [], "completion": []})
    with pytest.raises(ValueError, match=message):
        sft_trainer(tmp_path, preft.PreftLoraConfig(r=4), dataset=dataset)


@pytest.mark.slow
@pytest.mark.parallel  # make test-parallel
def test_accelerate_launch_runs_a_reft_p_recipe_on_two_processes(tmp_path):
    """ReFT-P under DDP (LoRA-P's DDP and FSDP runs are compared with one process in
    tests/test_distributed_training.py)."""
    out = tmp_path / "run"
    accelerate = Path(sys.executable).parent / "accelerate"
    proc = subprocess.run(
        [str(accelerate), "launch", "--config_file", str(CONFIGS / "accelerate" / "ddp.yaml"),
         "--main_process_port", str(free_port()), "-m", "preft", "train",
         str(CONFIGS / "sft_reft_p.yaml"), f"output_dir={out}", "trainer.max_steps=2",
         "trainer.report_to=none", "trainer.eval_strategy='no'", "trainer.save_steps=2", *TINY_SFT],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["peft_type"] == preft.PREFT_REFT


def test_conversational_dataset_prompt_length_is_the_templated_prompt(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": ex["prompt"]}],
             "completion": [{"role": "assistant", "content": ex["completion"].strip()}]}
            for ex in preft.data.user_examples(0, 8)]
    trainer = sft_trainer(tmp_path, preft.PreftLoraConfig(r=4), dataset=Dataset.from_list(rows))
    batch = next(iter(trainer.get_train_dataloader()))
    tokenizer = trainer.processing_class
    prompt_lengths = preft.context.prompt_lengths_from_labels(batch["labels"], batch["attention_mask"])
    for row, length in enumerate(prompt_lengths.tolist()):
        prompt_text = tokenizer.decode(batch["input_ids"][row][:length])
        assert prompt_text.endswith("assistant:") and prompt_text.count("user: rewrite") == 1, prompt_text
    trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.slow
def test_data_path_trains_the_shipped_recipe_on_the_users_own_rows(tmp_path):
    """``data.path=FILE`` on a recipe made for a generated task switches it to the user's rows."""
    rows = tmp_path / "mine.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i} twice:", "completion": f" {i} {i}"}) + "\n"
                            for i in range(24)))
    out = tmp_path / "run"
    assert cli_main(["train", str(CONFIGS / "sft_lora_p.yaml"), f"output_dir={out}", f"data.path={rows}",
                     "data.eval_examples=4", "trainer.max_steps=2", "trainer.per_device_train_batch_size=4",
                     "trainer.report_to=none", "trainer.save_strategy=no", "trainer.eval_strategy=no"]) == 0
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["data"] == {"task": "local", "path": str(rows),
                                                                   "eval_examples": 4}
