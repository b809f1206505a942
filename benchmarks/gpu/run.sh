#!/usr/bin/env bash
# Measure this project on a CUDA machine without network, in one command (docs/benchmarks.md#gpu):
#
#   benchmarks/gpu/run.sh                          # everything: gpu tests, then every single-GPU tier config
#   benchmarks/gpu/run.sh --skip-tests --only sft/qwen2.5-1.5b_1x24gb --steps 2
#
# Before, on a machine with network: `python benchmarks/gpu/wheels.py` puts the wheels the GPU
# machine lacks (bitsandbytes, jsonargparse, datasets...) into .whl/; bring that folder along.
#
# 1. installs .whl/*.whl into /tmp/site (no index, no dependencies) and runs with PYTHONPATH=/tmp/site:.
# 2. `python -m pytest -m gpu`: every GPU-marked test           -> $OUT/gpu_tests.txt
# 3. `python -m benchmarks.gpu.tiers`: each single-GPU tier config for a few steps, the card capped
#    to the tier; fits or not, peak allocated/reserved per phase beside the estimate, batch time,
#    tokens/s                                                   -> $OUT/gpu_tiers.md (the rows for
#    docs/benchmarks.md), $OUT/gpu_tiers.json, $OUT/runs/<config>/memory.{csv,png} and run.log
# Options other than --skip-tests go to step 3 (--only, --steps, --timeout, --list; see --help there).
# $OUT defaults to runs/gpu, $PYTHON to python3, $WHEELS (the wheel folder) to .whl, $SITE to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT="${OUT:-runs/gpu}"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
SITE="${SITE:-/tmp/site}"
run_tests=1
tier_args=()
for arg in "$@"; do
  case "$arg" in
    --skip-tests) run_tests=0 ;;
    *) tier_args+=("$arg") ;;
  esac
done
mkdir -p "$OUT"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH="$SITE:.${PYTHONPATH:+:$PYTHONPATH}"
# Nothing may try the network: models are built from assets/hub configs, data is generated.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# What is missing fails here in one line, not deep inside a run.
"$PYTHON" - <<'EOF' || exit 1
import importlib.util, sys
missing = [m for m in ("bitsandbytes", "jsonargparse", "docstring_parser", "typeshed_client", "datasets")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing {missing}: run `python benchmarks/gpu/wheels.py` on a machine with network and bring .whl/")
import torch
print(f"torch {torch.__version__}, CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
EOF

if (( run_tests )); then
  echo "== python -m pytest -m gpu"
  "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" >"$OUT/gpu_tests.txt" 2>&1
  echo "pytest -m gpu: exit $? ($OUT/gpu_tests.txt)"
  tail -n 5 "$OUT/gpu_tests.txt"
fi

# -- GPU step time (issue #37, helper "compile"): the recipe's SFT step against a bare loop at the
# Qwen2.5-0.5B/1.5B architectures, plain and with compile/Liger -> $OUT/gpu_step_time.{md,json,csv}.
# Stopped after 5 minutes at most; rows are written as they finish. Without CUDA it stops at once.
echo "== python -m benchmarks.gpu.step_time"
timeout 300 "$PYTHON" -m benchmarks.gpu.step_time --out "$OUT" || echo "benchmarks.gpu.step_time: exit $?"

echo "== python -m benchmarks.gpu.tiers"
exec "$PYTHON" -m benchmarks.gpu.tiers --out "$OUT" "${tier_args[@]}"
