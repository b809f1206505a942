#!/usr/bin/env bash
# Measure this project on a CUDA machine without network, in one command (docs/benchmarks.md#gpu),
# inside a lent machine's 15 minutes:
#
#   benchmarks/gpu/run.sh                          # everything: gpu tests, then every single-GPU tier config
#   benchmarks/gpu/run.sh --skip-tests --only sft/qwen2.5-1.5b_1x24gb --steps 2
#
# Before, on a machine with network: `python benchmarks/gpu/wheels.py` puts the wheels the GPU
# machine lacks (bitsandbytes, jsonargparse, datasets...) into .whl/; bring that folder along.
#
# 1. installs .whl/*.whl into /tmp/site (no index, no dependencies) and runs with PYTHONPATH=/tmp/site:.
# 2. `python -m benchmarks.gpu.gpu_tests`: every file with GPU-marked tests, each in a process of its
#    own (a crash from C costs that file only), a line per file as it ends  -> $OUT/gpu_tests.txt
#    and $OUT/gpu_tests/<file>.log
# 3. `python -m benchmarks.gpu.tiers`: each single-GPU tier config for a few steps, the card capped
#    to the tier, configs whose caps fit the card together at once (three 24 GB tiers on 80 GB);
#    fits or not, peak allocated/reserved per phase beside the estimate, batch time, tokens/s
#                                                               -> $OUT/gpu_tiers.md (the rows for
#    docs/benchmarks.md), $OUT/gpu_tiers.json, $OUT/runs/<config>/memory.{csv,png} and run.log
# 4. `python -m benchmarks.gpu.step_time`: the recipe's SFT step against a bare loop (issue 37)
#    -> $OUT/gpu_step_time.{md,json,csv}; then its parts at 0.5B (without SharedCasts, each Liger
#    kernel alone) -> $OUT/step_time_parts/gpu_step_time.{md,json,csv}.
# 5. `python -m benchmarks.gpu.rollout_speed`: the PPO rollout's paths (generate, the static decode loop
#    eager and compiled, LoRA merged or not) at the two 24 GB PPO configs' shapes (issue 43)
#    -> $OUT/rollout_speed.{md,json}; stopped after 6 minutes at most, rows written as they finish.
# It ends with one summary: a line per step, printed even when a step crashed or was interrupted.
# Options other than --skip-tests, --skip-tiers, --skip-step-time and --skip-rollout go to step 3 (--only, --steps, --timeout, --jobs,
# --list; see --help there). $OUT defaults to runs/gpu, $PYTHON to python3, $WHEELS (the wheel
# folder) to .whl, $SITE to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT="${OUT:-runs/gpu}"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
SITE="${SITE:-/tmp/site}"
run_tests=1
run_tiers=1
run_step_time=1
run_rollout=1
tier_args=()
for arg in "$@"; do
  case "$arg" in
    --skip-tests) run_tests=0 ;;
    --skip-tiers) run_tiers=0 ;;
    --skip-step-time) run_step_time=0 ;;
    --skip-rollout) run_rollout=0 ;;
    *) tier_args+=("$arg") ;;
  esac
done
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
status=0

# The summary is printed on every exit: the end of the script, an error, Ctrl-C or a kill.
print_summary() {
  echo "== summary"
  if [[ -s "$SUMMARY" ]]; then cat "$SUMMARY"; else echo "(no step finished)"; fi
}
trap print_summary EXIT

# step NAME COMMAND...: runs one step, its output as it comes; its last line goes to the summary.
step() {
  local name="$1"; shift
  echo "== $name"
  local log="$OUT/$name.out"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local last
  last="$(grep -v '^\s*$' "$log" | tail -n 1)"
  echo "$name: exit $rc: $last" >>"$SUMMARY"
  (( rc == 0 )) || status=1
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH="$SITE:.${PYTHONPATH:+:$PYTHONPATH}"
# Nothing may try the network: models are built from assets/hub configs, data is generated.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# What is missing fails here in one line, not deep inside a run.
"$PYTHON" - <<'PY' || exit 1
import importlib.util, sys
missing = [m for m in ("bitsandbytes", "jsonargparse", "docstring_parser", "typeshed_client", "datasets")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing {missing}: run `python benchmarks/gpu/wheels.py` on a machine with network and bring .whl/")
import torch
print(f"torch {torch.__version__}, CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PY

if (( run_tests )); then
  step gpu_tests "$PYTHON" -m benchmarks.gpu.gpu_tests --out "$OUT"
fi

if (( run_tiers )); then
  step gpu_tiers "$PYTHON" -m benchmarks.gpu.tiers --out "$OUT" "${tier_args[@]}"
fi

# -- GPU step time (issue #37): the recipe's SFT step against a bare loop at the Qwen2.5-0.5B/1.5B
# architectures, plain and with compile/Liger -> $OUT/gpu_step_time.{md,json,csv}. Stopped after
# 5 minutes at most; rows are written as they finish. Without CUDA it stops at once.
if (( run_step_time )); then
  step gpu_step_time timeout 300 "$PYTHON" -m benchmarks.gpu.step_time --out "$OUT"
  # Which part costs what at 0.5B, where Liger was slower than the bare loop (1.122x, 2026-11-26).
  step gpu_step_time_parts timeout 180 "$PYTHON" -m benchmarks.gpu.step_time --out "$OUT/step_time_parts" \
    --models Qwen/Qwen2.5-0.5B-Instruct --options none,no-shared-casts,liger,liger:rms_norm,liger:swiglu,liger:rope
fi

# -- PPO rollout paths (issue 43) -> $OUT/rollout_speed.{md,json}.
if (( run_rollout )); then
  step rollout_speed timeout 360 "$PYTHON" -m benchmarks.gpu.rollout_speed --out "$OUT"
fi

exit $status
