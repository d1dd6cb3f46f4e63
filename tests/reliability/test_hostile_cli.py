"""The CLIs under careless or hostile input (issue: reliability and security): `preft export`
and `preft train` refuse bad input in one line naming the problem, before writing anything, and
never delete or overwrite what the user owns; `preft train` resumes from the newest complete
checkpoint and never trains past max_steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ADAPTER_CONFIGS
from preft.cli import main as cli_main
from preft.bundle import ExportError
from preft.export import export_adapter

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"
TINY_SFT = ["data.train_examples=64", "data.eval_examples=16", "trainer.per_device_train_batch_size=4",
            "trainer.per_device_eval_batch_size=8", "trainer.logging_steps=1", "trainer.eval_steps=2"]


# ---------------------------------------------------------------- preft export


def test_export_refusals(saved_adapter, base_path, tmp_path, tokenizer):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"]())
    out = tmp_path / "bundle"

    with pytest.raises(ExportError, match="adapter directory not found"):
        export_adapter(tmp_path / "missing", base_path, out)
    with pytest.raises(ExportError, match="over the server's max rank 4"):
        export_adapter(adapter, base_path, out, max_rank=4)

    # wrong base: a Qwen2 with another hidden size
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
                     ).save_pretrained(tmp_path / "other_base")
    with pytest.raises(ExportError, match="wrong base model"):
        export_adapter(adapter, tmp_path / "other_base", out)

    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    first = sorted(tensors)[0]
    save_file({**tensors, first: torch.full_like(tensors[first], float("nan"))}, str(weights))
    with pytest.raises(ExportError, match="NaN or infinite"):
        export_adapter(adapter, base_path, out)

    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ExportError, match="corrupt or unreadable"):
        export_adapter(adapter, base_path, out)
    weights.unlink()
    with pytest.raises(ExportError, match="adapter weights not found"):
        export_adapter(adapter, base_path, out)

    (adapter / "adapter_config.json").write_text("{ not json")
    with pytest.raises(ExportError, match="adapter config is not valid JSON"):
        export_adapter(adapter, base_path, out)
    assert not out.exists()  # nothing half-written


def test_cli_export_error_is_one_line(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path / "nope"), "--base", "default", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "adapter directory not found" in err


def test_export_never_destroys_what_it_did_not_create(saved_adapter, base_path, tmp_path, capsys):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"](adapter_start=1))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_adapter(adapter, base_path, precious)
    with pytest.raises(ExportError, match="not a PreFT bundle"):
        export_adapter(adapter, base_path, precious, overwrite=True)
    with pytest.raises(ExportError, match="holds the adapter being exported"):  # -o above the source
        export_adapter(adapter, base_path, tmp_path, overwrite=True)
    (tmp_path / "a_file").write_text("x")
    assert cli_main(["export", str(adapter), "--base", "default", "-o", str(tmp_path / "a_file")]) == 2
    assert "is an existing file" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "mine" and (tmp_path / "a_file").read_text() == "x"
    assert (adapter / "adapter_model.safetensors").is_file()
    # an existing bundle is replaced with --overwrite, and only then; no temporary directory is left
    export_adapter(adapter, base_path, tmp_path / "bundle")
    with pytest.raises(ExportError, match="already exists"):
        export_adapter(adapter, base_path, tmp_path / "bundle")
    assert cli_main(["export", str(adapter), "--base", "default", "-o", str(tmp_path / "bundle"), "--overwrite"]) == 0
    assert not [p for p in tmp_path.iterdir() if "preft-" in p.name]


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: c.pop("r"), "has no 'r'"),
    (lambda c, t: c.update(r="8"), "r must be an integer >= 1"),
    (lambda c, t: c.update(adapter_start=-5), "adapter_start must be an integer >= 0"),
    (lambda c, t: c.update(prefill_only="false"), "prefill_only must be true or false"),
    (lambda c, t: c.update(lora_alpha=1e30), "lora_alpha / r"),
    (lambda c, t: [t.pop(k) for k in [k for k in t if "lora_B" in k]], "lack lora_A or lora_B"),
    (lambda c, t: t.update({k: v * 1e6 for k, v in t.items()}), "magnitude"),
])
def test_hand_edited_lora_configs_are_refused_with_the_field_named(saved_adapter, base_path, tmp_path, edit, message):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"]())
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    edit(config, tensors)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match=message):
        export_adapter(adapter, base_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("intervention"), "intervention must be 'loreft' or 'direft'"),
    (lambda c: c.pop("rank"), "has no 'rank'"),
])
def test_hand_edited_reft_configs_are_refused(saved_adapter, base_path, tmp_path, edit, message):
    adapter = saved_adapter(ADAPTER_CONFIGS["loreft_p"]())
    config = json.loads((adapter / "adapter_config.json").read_text())
    edit(config)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=message):
        export_adapter(adapter, base_path, tmp_path / "out")


def test_a_config_that_is_not_an_object_is_refused(saved_adapter, base_path, tmp_path):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"]())
    (adapter / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ExportError, match="must be a JSON object"):
        export_adapter(adapter, base_path, tmp_path / "out")


# ---------------------------------------------------------------- preft train


@pytest.mark.slow
def test_resume_skips_an_incomplete_checkpoint_and_never_trains_past_max_steps(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["train", str(CONFIGS / "sft_lora_p.yaml"), f"output_dir={out}", "trainer.report_to=none",
              "trainer.save_steps=2", "trainer.eval_strategy=no", *TINY_SFT]
    assert cli_main([*common, "trainer.max_steps=4"]) == 0
    (out / "checkpoint-4" / "trainer_state.json").unlink()  # a crash while saving, say
    assert cli_main([*common, "trainer.max_steps=4", "resume_from_checkpoint=true"]) == 0
    assert "skipping incomplete" in capsys.readouterr().out
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4]  # 3-4 again, from 2
    assert cli_main([*common, "trainer.max_steps=4", "resume_from_checkpoint=true"]) == 0  # a finished run
    assert "nothing left to train" in capsys.readouterr().out
    assert json.loads((out / "run_summary.json").read_text())["steps"] == 4
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=abc", "trainer.max_steps must be int, got 'abc'"),
    ("trainer.learning_rate=fast", "trainer.learning_rate must be float, got 'fast'"),
    ("trainer.per_device_train_batch_size=0", "trainer.per_device_train_batch_size must be > 0"),
    ("data.user=abc", "data.user must be an integer >= 0"),
    ("adapter.r=big", "adapter.r must be int"),
    ("trainer.save_strategy=sometimes", "trainer"),  # the dataclass's own check, still one line
])
def test_bad_override_values_fail_in_one_line_before_anything_is_written(tmp_path, capsys, override, message):
    out = tmp_path / "run"
    assert cli_main(["train", str(CONFIGS / "sft_lora_p.yaml"), f"output_dir={out}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_override_values_are_read_as_their_field_types():
    from trl import SFTConfig

    from preft.recipe_config import load_config
    from preft.recipes.common import build_trl_args

    config = load_config(CONFIGS / "sft_lora_p.yaml", ["trainer.save_strategy=no", "trainer.learning_rate=1e-3",
                                                       "trainer.report_to=none"])
    assert config["trainer"]["save_strategy"] == "no" and config["trainer"]["learning_rate"] == 1e-3
    from preft import precision

    args = build_trl_args(SFTConfig, precision.apply(config["precision"], config["trainer"], announce=lambda _: None),
                          "unused")  # as the recipe builds them: the machine's device and the YAML's precision
    assert str(args.save_strategy.value) == "no" and args.learning_rate == 1e-3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learning_rate=0.1"], "unknown recipe key 'learning_rate'"),
        (["trainer.max_steps=1", "trainer.learnin_rate=1"], "unknown recipe key 'trainer.learnin_rate'"),
        (["model=/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
        (["adapter.type=prefix_tuning"], "adapter.type 'prefix_tuning' is not supported"),
        (["adapter.rank=4"], "unknown recipe key 'adapter.rank'"),
        (["data.task=poetry"], "data.task 'poetry' is not supported"),
        (["data.train_examples=0"], "data.train_examples must be an integer >= 1, got 0"),
        (["adapter.r=0"], "adapter.r must be > 0, got 0"),
    ],
)
def test_bad_recipe_input_is_one_line_and_writes_nothing(tmp_path, capsys, overrides, message):
    out = tmp_path / "run"
    code = cli_main(["train", str(CONFIGS / "sft_lora_p.yaml"), f"output_dir={out}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert __import__("re").search(message, err), err
    assert not out.exists()


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("  temperature: 0.7", "  temprature: 0.7", "unknown GRPOConfig field(s) ['temprature']"),
        ("  r: 16", "  rank: 16", "adapter: unknown PreftLoraConfig field(s) ['rank']"),
    ],
)
def test_config_file_typos_are_named(tmp_path, capsys, old, new, message):
    config = tmp_path / "c.yaml"
    config.write_text((CONFIGS / "grpo_lora_p.yaml").read_text().replace(old, new))
    assert cli_main(["train", str(config), f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and (new.split(":")[0].strip() in err)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- reliability II: output directories are PreFT's own


def _user_checkpoints(directory: Path) -> dict[Path, str]:
    """An earlier run's checkpoints and a user's note inside one, as the issue found them deleted."""
    files = {}
    for step in (50, 100):
        checkpoint = directory / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        for name in ("trainer_state.json", "adapter_model.safetensors"):
            files[checkpoint / name] = f"{name} of step {step}"
    files[directory / "checkpoint-50" / "my_notes.txt"] = "the user's own notes"
    files[directory / "adapter" / "adapter_config.json"] = "the user's adapter"
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


@pytest.mark.slow
def test_train_never_deletes_or_overwrites_what_it_did_not_write(tmp_path, capsys):
    """Before: exit 0 and no warning; checkpoint-50 and checkpoint-100 deleted by HF's rotation
    (save_total_limit 2), adapter/ and run_summary.json overwritten."""
    out = tmp_path / "existing"
    files = _user_checkpoints(out)
    common = ["train", str(CONFIGS / "sft_lora_p.yaml"), f"output_dir={out}", "trainer.report_to=none",
              "trainer.max_steps=6", "trainer.save_steps=2", "trainer.eval_strategy=no", *TINY_SFT]
    assert cli_main(common) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty and holds no run to resume" in err \
        and "overwrite_output_dir=true" in err, err
    assert all(path.read_text() == text for path, text in files.items())
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "checkpoint-100", "checkpoint-50"]  # nothing written
    # explicitly: the run writes its own files, and its rotation (limit 2) deletes only its own checkpoints
    assert cli_main([*common, "overwrite_output_dir=true"]) == 0
    assert (out / "checkpoint-50" / "my_notes.txt").read_text() == "the user's own notes"
    assert (out / "checkpoint-100" / "trainer_state.json").read_text() == "trainer_state.json of step 100"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-100", "checkpoint-4", "checkpoint-50",
                                                                 "checkpoint-6"]
    # its own directory: a resume continues there; a plain rerun is refused like any other
    assert cli_main([*common, "trainer.max_steps=8", "resume_from_checkpoint=true"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-100", "checkpoint-50", "checkpoint-6",
                                                                 "checkpoint-8"]
    assert cli_main(common) == 2


def test_train_refuses_another_recipes_directory_and_a_bad_flag(tmp_path, capsys):
    from preft.output_dirs import claim

    out = tmp_path / "grpo_run"
    claim(out, "train:grpo", resume=False, overwrite=False, how_to_overwrite=None)
    (out / "checkpoint-2").mkdir()
    common = ["train", str(CONFIGS / "sft_lora_p.yaml"), f"output_dir={out}", "trainer.report_to=none"]
    assert cli_main([*common, "resume_from_checkpoint=true"]) == 2  # no complete checkpoint of this recipe
    assert cli_main([*common, "overwrite_output_dir=maybe"]) == 2
    err = capsys.readouterr().err
    assert "overwrite_output_dir must be true or false" in err
    assert sorted(p.name for p in out.iterdir()) == [".preft_owner.json", "checkpoint-2"]


def test_eval_results_directory_must_be_new_empty_or_an_eval_one(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    assert cli_main(["eval", "prefix", "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "is not empty and holds no run to resume" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize("name, text, message", [
    ("mixed.jsonl", "".join(json.dumps(r) + "\n" for r in [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(5)]
                            + [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]),
     "mixed.jsonl (train) row 5 (line 6) is a messages row, but row 0 is a prompt/completion row"),
    ("empty_cell.csv", "prompt,completion\np0,c0\np1,\np2,c2\n",
     "empty_cell.csv (train) row 1: its completion is missing (an empty cell or null)"),
    ("both.jsonl", json.dumps({"prompt": "a", "completion": "b", "messages": []}) + "\n",
     "both.jsonl (train) row 0 (line 1): it has both 'messages' and 'prompt'/'completion'"),
    ("number.jsonl", json.dumps({"prompt": "a", "completion": 3}) + "\n",
     "number.jsonl (train) row 0 (line 1): its completion is a int"),
])
def test_eval_loss_names_the_file_and_row_of_bad_data(tmp_path, capsys, name, text, message):
    """Before: a tokenizer's message ("You need to specify either `text` or `text_target`", "text
    input must be of type `str`") that named neither the file nor the row."""
    data = tmp_path / name
    data.write_text(text)
    assert cli_main(["eval", "loss", "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "1",
                     "--ranks", "1", "--methods", "lora_p"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out" / "loss").exists()
