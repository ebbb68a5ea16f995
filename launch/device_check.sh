#!/usr/bin/env bash
# The prepared accelerator check (docs/kernels.md, "Device check"): one script, at most
# ~9 minutes on an H200, every stage under its own `timeout`, results as JSON under $OUT
# (written as each stage goes, so a stage killed at its limit still leaves the others').
#
#   bash launch/device_check.sh             # on the GPU machine ($OUT set by the tool)
#   bash launch/device_check.sh --dry-run   # here, on CPU: every stage at toy size
#
# Stages (seconds allowed): install (30) the carried wheels in .whl/ (jax-triton,
# ml-collections: what the H200 image lacks; its jax 0.11, flax, optax, orbax, triton
# are used as they are; launch/fetch_device_wheels.sh downloads them); env (20); tests
# (90) the GPU-only tests (jax-triton kernel vs
# the reference, sm_90 compile); kernels (120) dsparse_jax.bench.kernels at 32k (first: the
# target's context), 4k, 16k and 128k x budgets 16/32/64 pages (device time per call from
# chains of 8 dependent calls; GB/s vs HBM peak, sparse vs dense decode; impl auto = the
# kernel the model runs); rollout (160) dsparse_jax.bench.rollout on a random
# Gemma-3-1B-shaped model in bf16 (decode steps at 4k and 16k, dense vs centroid-sparse,
# impl auto = the Triton kernel); speculative (100) dsparse_jax.bench.speculative on the
# same model shape in bf16 (plain sampling against the
# sparse_self, history and draft_head drafters, 256 tokens, B = 16). Sum of the limits:
# 520 s.
#
# Files under $OUT (six; the device tool brings back at most eight): stages.json (each
# stage's rc and seconds), stages.log (every stage's output, in order), env.json,
# bench_kernels.json, bench_rollout.json, bench_speculative.json.
set -u
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
STAGES="$OUT/stages.json"
LOG="$OUT/stages.log"
echo "[]" >"$STAGES"
: >"$LOG"
STAGE_LOG=$(mktemp)

stage() { # stage NAME SECONDS COMMAND...: run under timeout, log it, append {name, rc, s}
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout -k 5 "$limit" "$@" >"$STAGE_LOG" 2>&1
    local rc=$?
    cat "$STAGE_LOG" >>"$LOG"
    tail -n 5 "$STAGE_LOG"
    "$PY" - "$STAGES" "$name" "$rc" "$((SECONDS - t0))" "$limit" <<'EOF'
import json, sys
path, name, rc, s, limit = sys.argv[1:]
stages = json.load(open(path))
stages.append({"stage": name, "rc": int(rc), "seconds": int(s), "limit_s": int(limit),
               "timed_out": int(rc) in (124, 137)})
json.dump(stages, open(path, "w"), indent=1)
EOF
}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    stage install 30 "$PY" -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

stage env 20 "$PY" -c '
import json, platform, subprocess, sys, jax
try:
    import triton; tv = triton.__version__
except ImportError: tv = None
try:
    import jax_triton; jtv = getattr(jax_triton, "__version__", "?")
except ImportError as e: jtv = "missing: %s" % e
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip() \
      if __import__("shutil").which("nvidia-smi") else None
env = json.dumps({"python": platform.python_version(), "jax": jax.__version__,
                  "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
                  "triton": tv, "jax_triton": jtv, "nvidia_smi": smi}, indent=1)
print(env)
open(sys.argv[1], "w").write(env + "\n")' "$OUT/env.json"

if [ $DRY = 1 ]; then
    TESTS=(tests/test_kernels.py::test_dispatch_resolution_and_errors)
    TEST_PLATFORMS=cpu
    KARGS=(--contexts=4096 --budgets=16 --force_cpu_timing --impl=pallas_tpu --batch=1
        --kv_heads=1 --reps=2 --warmup=1 --chain=2 --dtype=float32)
    RARGS=(--preset=tiny --dtype=float32 --configs=dense,centroid:0 --skip_throughput
        --step_contexts=1024 --step_rounds=1 --step_reps=2 --floor_step=0)
    SARGS=(--quick --head_steps=5)
else
    TESTS=(tests/test_kernels.py tests/test_triton_compile.py -k "triton and not interpreter")
    TEST_PLATFORMS=cuda # tests/conftest.py defaults to cpu, which skips the GPU tests
    KARGS=(--contexts=32768,4096,16384,131072 --budgets=16,32,64 --reps=10 --warmup=2 --chain=8)
    RARGS=(--preset=gemma3_1b --dtype=bfloat16 --impl=auto --configs=dense,centroid:0
        --batch=16 --skip_throughput --step_contexts=4096,16384 --step_rounds=3
        --step_reps=10 --budget=32)
    SARGS=(--preset=gemma3_1b --dtype=bfloat16 --impl=auto --gen=256 --batch=16 --samples=4
        --budget=32 --head_rows=8 --head_steps=50)
fi

stage tests 90 env JAX_PLATFORMS=$TEST_PLATFORMS "$PY" -m pytest -q -p no:cacheprovider -rs "${TESTS[@]}"
stage kernels 120 "$PY" -m dsparse_jax.bench.kernels "${KARGS[@]}" \
    --out="$OUT/bench_kernels.json"
stage rollout 160 "$PY" -m dsparse_jax.bench.rollout "${RARGS[@]}" \
    --out="$OUT/bench_rollout.json"
[ -f "$OUT/bench_rollout.json.partial" ] && [ ! -f "$OUT/bench_rollout.json" ] &&
    mv "$OUT/bench_rollout.json.partial" "$OUT/bench_rollout.json"
stage speculative 100 "$PY" -m dsparse_jax.bench.speculative "${SARGS[@]}" \
    --out="$OUT/bench_speculative.json"

rm -f "$STAGE_LOG"
echo "== stages"
cat "$STAGES"
