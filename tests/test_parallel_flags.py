"""`preft serve`'s parallel sizes and WavePP flags: checked before start-up, thread binding set."""

from __future__ import annotations

import json

from preft.serving.parallel import cpu_thread_binding, parallel_problem
from preft.serving.scheduling.cost_model import StepCostModel

CONFIG = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}


def test_parallel_sizes_the_model_and_machine_cannot_take_are_named():
    assert parallel_problem(CONFIG, 2, 2, cores=4) is None
    assert parallel_problem(CONFIG, 8, 1, cores=None) is None  # KV heads replicated (8 % 2 == 0)
    assert "does not divide the model's 8 attention heads" in parallel_problem(CONFIG, 3, 1, cores=8)
    assert "more than the model's 4 layers" in parallel_problem(CONFIG, 1, 5, cores=8)
    assert "need a CPU core each" in parallel_problem(CONFIG, 2, 2, cores=2)
    assert "neither divides" in parallel_problem({"num_attention_heads": 12, "num_key_value_heads": 3}, 4, 1, None)


def test_cpu_thread_binding_splits_the_cores_evenly():
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4, 5, 6, 7]) == "0-3|4-7"
    assert cpu_thread_binding(3, [0, 1, 2, 3, 4, 5, 6]) == "0-1|2-3|4-5"
    assert cpu_thread_binding(2, [0, 2, 4, 6]) == "0,2|4,6"


def test_preft_serve_passes_parallel_sizes_and_binds_threads(tmp_path, monkeypatch):
    from preft.cli import build_parser
    from preft.serving.server import server_environment, vllm_arguments

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    args = build_parser().parse_args(["serve", "--pipeline-parallel-size", "2"])
    args.lora_adapters = []
    argv = vllm_arguments(args, tmp_path)
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2" and "--tensor-parallel-size" not in argv
    assert server_environment(args, tmp_path, {})["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")  # the user's own binding is kept
    assert server_environment(args, tmp_path, {})["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"
    plain = build_parser().parse_args(["serve"])
    plain.lora_adapters = []
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_environment(plain, tmp_path, {})


def test_preft_serve_refuses_bad_parallel_and_wavepp_flags_in_one_line(tmp_path, capsys, monkeypatch):
    from preft.cli import build_parser, main
    from preft.serving.server import server_environment

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    cost = StepCostModel.synthetic().save(tmp_path / "cost.json")
    for flags, message in ((["--tensor-parallel-size", "2"], "does not divide the model's 3 attention heads"),
                           (["--pipeline-parallel-size", "9"], "more than the model's 4 layers"),
                           (["--scheduler", "wavepp", "--cost-model", str(cost)], "needs --pipeline-parallel-size"),
                           (["--scheduler", "fixed:64", "--cost-model", str(cost)], "does not use it")):
        assert main(["serve", *flags, "--port", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    args = build_parser().parse_args(["serve", "--scheduler", "feather+sloweave+wavepp", "--pipeline-parallel-size",
                                      "2", "--cost-model", str(cost), "--tpot-ms", "50", "--min-chunk", "32"])
    args.lora_adapters = []
    spec = json.loads(server_environment(args, tmp_path, {})["PREFT_SCHEDULER"])
    assert spec["name"] == "feather+sloweave+wavepp" and spec["min_chunk"] == 32
    learned = build_parser().parse_args(["serve", "--scheduler", "wavepp", "--pipeline-parallel-size", "2"])
    learned.lora_adapters = []  # no --cost-model: WavePP learns its cost model online
    spec = json.loads(server_environment(learned, tmp_path, {})["PREFT_SCHEDULER"])
    assert spec["name"] == "wavepp" and "cost_model" not in spec
