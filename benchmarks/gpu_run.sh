#!/usr/bin/env bash
# The paper's GPU cost in one call of under 8 minutes on one H200 (bench_gpu.py --paper).
#
#   benchmarks/gpu_run.sh prepare [CARRY]                 on a machine that reaches PyPI: CARRY (default .carry)
#                                                         gets wheels/ (what a bare GPU image lacks, at the versions
#                                                         installed here) and tokenizer/ (the embedded SmolLM2's)
#   benchmarks/gpu_run.sh run [CARRY] [OUT] [FLAGS...]    on the GPU machine, offline: installs CARRY/wheels into a
#                                                         private folder, runs bench_gpu.py --paper FLAGS, and writes
#                                                         OUT (default runs/gpu) /bench_gpu.json and bench_gpu.log
#
# FLAGS go to bench_gpu.py: --tiny runs the same on a CPU in about a minute; --stages train,peers runs some stages.
# PYVER (default 3.12, the GPU image's Python) is the Python the wheels are for. LIMIT (default 420) is the bench's
# hard limit in seconds: --paper starts no stage after 330 s, and at LIMIT an interrupt ends the stage in flight.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
carry=${2:-.carry}
# transformers, accelerate and the hub client at the versions tested here: the image may hold older ones
CARRIED="transformers tokenizers safetensors huggingface-hub hf-xet regex accelerate tqdm jinja2 markupsafe psutil pyyaml
packaging filelock fsspec"

case "$mode" in
prepare)
    mkdir -p "$carry/wheels"
    # shellcheck disable=SC2086  # $CARRIED is a word list
    pins=$(python3 - $CARRIED <<'PY'
import importlib.metadata as m
import sys

try:
    print(" ".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))
except m.PackageNotFoundError as e:
    sys.exit(f"gpu_run.sh prepare: {e} is not installed here; pip install it first (its version is the one carried)")
PY
)
    platforms=""
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms="$platforms --platform $p"
    done
    # shellcheck disable=SC2086  # $pins and $platforms are word lists
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
        $platforms -d "$carry/wheels" $pins
    python3 - "$carry/tokenizer" <<'EOF'
import sys

sys.path.insert(0, ".")
import privact
from transformers import AutoTokenizer

AutoTokenizer.from_pretrained(privact.model_source("smollm2")).save_pretrained(sys.argv[1])
EOF
    du -sh "$carry" | sed 's/^/carried: /'
    ;;
run)
    out=${3:-runs/gpu}
    shift $(($# < 3 ? $# : 3))
    mkdir -p "$out"
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$carry"/wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
            lscpu 2>/dev/null | grep -m1 'Model name' || uname -m
        python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
        # a hard limit: at LIMIT seconds an interrupt ends the stage in flight, and the JSON keeps what was measured
        timeout --preserve-status -s INT -k 60 "${LIMIT:-420}" \
            python3 benchmarks/bench_gpu.py --paper --tokenizer "$carry/tokenizer" --json "$out/bench_gpu.json" "$@"
    } 2>&1 | tee "$out/bench_gpu.log"
    ;;
*)
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
