#!/usr/bin/env bash
# Every GPU check of this repository in one command, for a lent GPU machine whose Python has
# PyTorch but not this project's other requirements (the "device" tool: see bench/README.md,
# "On a GPU"). Each part has its own time limit, so that one slow part does not lose the others'
# results; logs and tables go to $OUT (or ./gpu_out).
#
#   bash bench/gpu_session.sh [quick]      # quick: small sizes, for a dry run on a CPU
#
# Missing packages travel as wheels in .whl/ (pip download ... --python-version 3.12, see
# bench/README.md); where the project's requirements are missing they are unpacked into /tmp/site.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
QUICK=${1:-}
if ! python3 -c "import transformer_lens, wandb, tracr, haiku, jsonargparse" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else  # packages found where they are (an earlier sitting's /tmp/site on PYTHONPATH included)
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export WANDB_MODE=disabled WANDB_SILENT=true PYTHONUNBUFFERED=1
# tracr compiles with JAX: keep JAX on the CPU and off the GPU's memory
export JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
DEVICE=cuda
python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())" || exit 1
python3 -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" || DEVICE=cpu
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi

FAILED=""
part() {  # part NAME SECONDS COMMAND...: run one part under its limit, log to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s"
    tail -n 25 "$OUT/$name.log"
    [ $rc -eq 0 ] || FAILED="$FAILED $name"
}

if [ "$QUICK" = quick ]; then
    STEPS=20; MEMBERS="1 4"; GROK=200; CHAINS="2"; DRAWS=20
else
    STEPS=${POP_STEPS:-300}; MEMBERS=${MEMBERS:-"1 16 64"}; GROK=${GROK_STEPS:-12000}; CHAINS="2 8"; DRAWS=100
fi
# what runs (PARTS), and settings a second sitting may change: GROK_PARTS and GROK_STATE (a
# state file of earlier grokking parts, carried along), GROK_STEPS, GROK_PROFILE (set: each
# grokking fit part's cProfile to $OUT/profile_<part>.txt), POP_CONFIGS, MEMBERS and POP_STEPS
# (not in quick mode), POP_SOLO (runs alone timed), POP_PROBES (none, default or both:
# population.py's --probes), POP_BASELINE (a folder holding the phasewatch package before a
# change: population.py's --baseline_tree, timed beside this tree's in the same part), each
# part's limit in seconds (TEST_GPU_S, GROK_S, POP_S, LLC_S), and TEST_GPU_K (pytest's -k for
# the GPU tests).
# The parts' limits add up to 560 s: with the install, one lent machine's 10-minute command
# holds all four only just; give a second sitting the parts the first did not finish.
PARTS=${PARTS:-"test_gpu grokking population llc"}
for p in $PARTS; do
    case $p in test_gpu|grokking|population|llc) ;; *) echo "unknown part $p (test_gpu, grokking, population, llc)"; exit 2 ;; esac
done
GROK_STATE=${GROK_STATE:-$OUT/grok_state.json}
if [ "$GROK_STATE" != "$OUT/grok_state.json" ] && [ -f "$GROK_STATE" ]; then cp "$GROK_STATE" "$OUT/grok_state.json"; fi
POP_CONFIGS=${POP_CONFIGS:-"configs/induction_2l.yaml configs/reverse.yaml configs/quickstart.yaml"}
# in the order of what matters most: correctness on the device, then the timings
for p in $PARTS; do
    case $p in
    test_gpu) part test_gpu "${TEST_GPU_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu.py \
        ${TEST_GPU_K:+-k "$TEST_GPU_K"} ;;
    grokking) part grokking "${GROK_S:-200}" python3 bench/gpu_grokking.py --device "$DEVICE" --steps "$GROK" --out "$OUT/RESULTS.md" \
        --state "$OUT/grok_state.json" --parts "${GROK_PARTS:-loop,fit,bare}" ${GROK_PROFILE:+--profile "$OUT/profile.txt"} ;;
    population) part population "${POP_S:-150}" python3 bench/population.py --part train --markdown --device "$DEVICE" \
        --config $POP_CONFIGS --members $MEMBERS --steps "$STEPS" ${POP_BASELINE:+--baseline_tree "$POP_BASELINE"} \
        ${POP_SOLO:+--solo "$POP_SOLO"} ${POP_PROBES:+--probes $POP_PROBES} ;;
    llc) part llc "${LLC_S:-60}" python3 bench/population.py --part llc --markdown --device "$DEVICE" --config configs/induction_2l.yaml \
        configs/reverse.yaml --chains $CHAINS --draws "$DRAWS" --burn_in 50 ;;
    esac
done
[ -z "$FAILED" ] || { echo "failed or stopped at the limit:$FAILED"; exit 1; }
