#!/usr/bin/env bash
# The training side on one CUDA GPU, in a few minutes, on a machine with PyTorch but no vLLM.
#
#   bash bench/gpu_check.sh prepare   # here (any machine with models/smollm2-135m-instruct): writes
#                                     # runs/gpu_check/models/ = SmolLM2's config + tokenizer, no weights (4 MB)
#   bash bench/gpu_check.sh           # on the GPU machine (carry runs/gpu_check along): all three parts
#   bash bench/gpu_check.sh bench     # only part 1 (or: train, tests; several at once): one part per device call
#                                     # keeps each call inside the device tool's 10-minute limit
#
# What it runs there (about 12 minutes on an H200 in all; the device tool's whole lease is 15):
#   1. bench/gpu_bench.py: the trainer's log-prob pass and update on the R1-Distill-Qwen-1.5B shape, model TFLOP/s,
#      share of the bf16 peak, memory per token, padding, eager and with --compile; with .before/ (git archive OLD | tar -x -C .before,
#      carried along) the padded trainer of that commit too, for before/after in one run.
#   2. torchrun --nproc_per_node 1 train.py --engine hf (one rank, NCCL, bf16 mixed precision) on a small random
#      Llama (hidden 512, 8 layers; built there from the tokenizer) with --grad-checkpointing off and on, printing
#      the peak CUDA memory of the PPO update and of the whole run: checkpointing must lower the update peak; then
#      once more with --compile added (it must run; its peak is printed), and with --lora-rank 16 (its whole-run
#      peak must be below full fine-tuning's: no fp32 master weights, gradients or Adam state for the base).
#   3. the pytest files that need no vLLM (vLLM tests skip themselves with a printed reason).
# Environment: PYTHON (default python3), BENCH_VARIANTS (gpu_bench --variants), BENCH_TIMEOUT (420), STEP_TIMEOUT
# (240 per training run), TEST_TIMEOUT (300), GPU_CHECK_WORK (runs/gpu_check; a folder of its own lets two parts
# run at once); OUT: a folder that gets gpu_bench.json and pytest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-runs/gpu_check}  # one per concurrent invocation

if [[ "${1:-}" == "prepare" ]]; then
    src=${MUTIS_MODELS_DIR:-models}/smollm2-135m-instruct
    [[ -f $src/config.json ]] || { echo "no $src: run 'python model.py prepare' first"; exit 1; }
    mkdir -p "$WORK/models/smollm2-135m-instruct"
    for f in "$src"/*; do [[ $(basename "$f") == *.safetensors ]] || cp "$f" "$WORK/models/smollm2-135m-instruct/"; done
    du -sh "$WORK"
    exit 0
fi
PARTS=" ${*:-bench train tests} "
for part in $PARTS; do
    [[ $part =~ ^(bench|train|tests)$ ]] || { echo "gpu_check.sh: unknown part '$part' (prepare, bench, train, tests)"; exit 2; }
done

echo "== machine"
nvidia-smi -L || echo "nvidia-smi: none"
"$PY" - <<'EOF' || exit 1
import importlib, sys, torch
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"available {torch.cuda.is_available()}  devices {torch.cuda.device_count()}")
missing = [m for m in ("transformers", "safetensors", "numpy", "tqdm", "pyarrow", "pytest", "math_verify", "sympy")
           if importlib.util.find_spec(m) is None]
for m in ("transformers", "vllm", "flash_attn"):
    if importlib.util.find_spec(m):
        print(m, importlib.import_module(m).__version__)
if missing:
    print("MISSING python packages:", ", ".join(missing), "(pytest/math_verify/sympy only matter for step 2)")
if not torch.cuda.is_available() or any(m in missing for m in ("transformers", "safetensors", "numpy", "tqdm")):
    sys.exit("cannot run the GPU check here")
EOF

# models: SmolLM2's tokenizer (the tokenizer-only copy, or the real directory) and two random Llamas built from it
if [[ -z "${MUTIS_MODELS_DIR:-}" ]]; then
    if [[ -f models/smollm2-135m-instruct/config.json ]]; then export MUTIS_MODELS_DIR=$PWD/models
    else export MUTIS_MODELS_DIR=$PWD/$WORK/models; fi
fi
[[ -f $MUTIS_MODELS_DIR/smollm2-135m-instruct/tokenizer.json ]] || {
    echo "no tokenizer under $MUTIS_MODELS_DIR: run 'bash bench/gpu_check.sh prepare' where models/ exists"; exit 1; }
mkdir -p "$WORK"
fail=0
"$PY" - <<EOF || exit 1
import model
model.make_tiny("$WORK/tiny")
model.make_tiny("$WORK/small", hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536)
print("built $WORK/tiny and $WORK/small")
EOF
MODELS="$WORK/small"

# train.main with the peak CUDA memory of each PPO update recorded (reset before it, read after it)
cat > "$WORK/peak.py" <<'EOF'
import json, sys
import torch
sys.path.insert(0, ".")
import train
peaks, overall = [], [0]
real_update = train.ppo_update
def ppo_update(*a, **k):
    overall[0] = max(overall[0], torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    out = real_update(*a, **k)
    peaks.append(torch.cuda.max_memory_allocated())
    return out
train.ppo_update = ppo_update
train.main(sys.argv[1:])
overall[0] = max([overall[0], torch.cuda.max_memory_allocated()] + peaks)
print("PEAK " + json.dumps({"update_gib": round(max(peaks) / 2**30, 4), "run_gib": round(overall[0] / 2**30, 4)}),
      flush=True)
EOF

if [[ $PARTS == *" bench "* ]]; then
echo "== bench/gpu_bench.py: model TFLOP/s, memory per token, padding (before: .before/, an earlier commit, if present)"
bench_args=(); [[ -f .before/train.py ]] && bench_args=(--before .before)
[[ -n "${BENCH_VARIANTS:-}" ]] && bench_args+=(--variants "$BENCH_VARIANTS")
timeout "${BENCH_TIMEOUT:-420}" "$PY" bench/gpu_bench.py "${bench_args[@]}" --out "$WORK/gpu_bench.json" \
    || { echo "gpu_bench: FAILED or timed out"; fail=1; }
[[ -n "${OUT:-}" && -f $WORK/gpu_bench.json ]] && cp "$WORK/gpu_bench.json" "$OUT/"
fi

if [[ $PARTS == *" train "* ]]; then
echo "== train.py --engine hf, 1 rank, NCCL, bf16 mixed precision"
declare -A PEAK RUN
check_lower() {  # LABEL BEFORE_GIB AFTER_GIB: AFTER must be below BEFORE (skipped where a run printed no peak)
    [[ -n $2 && -n $3 ]] || return 0
    local verdict
    verdict=$("$PY" -c "print('OK: lower' if $3 < $2 else 'FAIL: not lower')")
    echo "CHECK $1: $2 GiB -> $3 GiB: $verdict"
    [[ $verdict == OK* ]] || fail=1
}
for m in $MODELS; do
    for gc in off on compile lora; do
        out=$WORK/out-$(basename "$m")-$gc
        rm -rf "$out"
        flag=(); [[ $gc == on ]] && flag=(--grad-checkpointing)
        [[ $gc == compile ]] && flag=(--grad-checkpointing --compile)
        [[ $gc == lora ]] && flag=(--lora-rank 16)
        t0=$(date +%s)
        timeout "${STEP_TIMEOUT:-240}" "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 "$WORK/peak.py" \
            --model "$m" --data arith_train --out "$out" --steps 2 --batch-size 4 --samples-per-prompt 2 \
            --max-turns 1 --turn-tokens 256 --micro-batch-size 8 --mini-batch-size 8 --engine hf \
            --dtype bfloat16 --engine-dtype bfloat16 "${flag[@]}" > "$out.log" 2>&1
        rc=$?
        line=$(grep '^PEAK ' "$out.log" | tail -1)
        echo "$(basename "$m") ${flag[*]:-no flags} rc=$rc $(( $(date +%s) - t0 ))s ${line:-no PEAK line}"
        grep '^step ' "$out.log" | tail -2
        if [[ $rc -ne 0 ]]; then tail -25 "$out.log"; fail=1; fi
        PEAK[$m-$gc]=$(echo "$line" | sed -n 's/.*"update_gib": \([0-9.]*\).*/\1/p')
        RUN[$m-$gc]=$(echo "$line" | sed -n 's/.*"run_gib": \([0-9.]*\).*/\1/p')
    done
    check_lower "$(basename "$m"): update peak, --grad-checkpointing off -> on" "${PEAK[$m-off]:-}" "${PEAK[$m-on]:-}"
    check_lower "$(basename "$m"): run peak, full -> --lora-rank 16" "${RUN[$m-off]:-}" "${RUN[$m-lora]:-}"
done
fi

if [[ $PARTS == *" tests "* ]]; then
echo "== pytest: the files that need no vLLM"
timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider tests/test_data.py tests/test_reward.py \
    tests/test_ppo.py tests/test_model.py tests/test_packing.py tests/test_engine.py tests/test_train_units.py \
    tests/test_turn_rule.py tests/test_multirank.py tests/test_dtype.py tests/test_compile.py tests/test_gpu_path.py \
    tests/test_lora.py \
    -k "not smollm2_generates" -rs 2>&1 | tee "${OUT:-$WORK}/pytest.log" | tail -25
[[ ${PIPESTATUS[0]} -eq 0 ]] || fail=1
fi
echo "== gpu_check: $([[ $fail -eq 0 ]] && echo PASSED || echo FAILED)"
exit $fail
