#!/usr/bin/env bash
# The GPU check, prepared to run on a lent GPU machine (device tool) that
# reaches no package registry. Stage the carried files here first with scripts/device_stage.sh, then
# make two calls back to back (the machine stays warm only ~30 s between calls):
#   1. carry [.device/teacher-1]                 command: bash scripts/device_check.sh stash
#   2. carry [.device/teacher-2, .device/wheels] command: bash scripts/device_check.sh run
# `run` rebuilds the SmolLM2 GGUF (sha256-checked), installs luigi and gguf from the carried wheels
# if the image lacks them, runs the GPU tests (tests/test_device.py and the CUDA resume test), fla's
# linear-attention kernel against our PyTorch form (scripts/fla_check.py, fla-core from the wheels), the
# input pipeline's accelerator figure (bench/gpu_feed.py: one SmolLM2-shaped block's step time and
# device-busy fraction fed from memory, from the store synchronously, and prefetching), then the
# default experiment with device=cuda (the README's command plus `--set device=cuda`) and its
# per-phase MFU table (bench/mfu.py), and leaves log.txt, report.json, report.md, mfu.txt and
# nvidia-smi samples in $OUT.
# Env: ZG_DEVICE (default cuda; `cpu` rehearses the script on a machine without a GPU),
#      ZG_PRESET (default: the default experiment; e.g. `tiny` for a rehearsal),
#      ZG_STASH (default /root/zg-stash), ZG_RUN_TIMEOUT (seconds, default 420),
#      ZG_FEED_TIMEOUT (seconds for bench/gpu_feed.py, default 240; `--quick` when ZG_DEVICE=cpu),
#      ZG_FLA_TIMEOUT (seconds for scripts/fla_check.py, default 180).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: device_check.sh stash|run}
stash=${ZG_STASH:-/root/zg-stash}
device=${ZG_DEVICE:-cuda}
out=${OUT:-/tmp/zg-device-out}
mkdir -p "$out"
gguf_dir=outputs/teachers/smollm2-135m
gguf=$gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf

if [ "$mode" = stash ]; then
    mkdir -p "$stash" && cp .device/teacher-1/part "$stash/part-1" && ls -la "$stash"
    exit $?
fi
[ "$mode" = run ] || { echo "unknown mode $mode (stash|run)" >&2; exit 2; }

exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
step() { echo; echo "=== $(date -u +%T) $*"; }

step "teacher GGUF"
if [ ! -f "$gguf" ]; then
    [ -f "$stash/part-1" ] || { echo "no $stash/part-1: the machine was given back after 'stash'; call stash again, then run at once"; exit 3; }
    mkdir -p "$gguf_dir" && cat "$stash/part-1" .device/teacher-2/part > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
fi
[ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat .device/teacher-2/sha256)" ] || { echo "GGUF checksum mismatch"; exit 3; }
echo "ok: $gguf"

step "packages"
"$py" -c "import luigi, gguf" 2>/dev/null || "$py" -m pip install --no-index --find-links .device/wheels luigi gguf || exit 4
"$py" - <<'EOF' || exit 4
import sys, torch, transformers, luigi, h5py
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "luigi", getattr(luigi, "__version__", "?"), "h5py", h5py.__version__)
print("cuda available:", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi -L

step "GPU tests: tests/test_device.py, the CUDA SIGKILL-and-resume test"
"$py" -m pytest -q -p no:cacheprovider tests/test_device.py "tests/test_resume.py::test_sigkill_mid_block_resumes_to_identical_bytes" -rs
tests_rc=$?

step "fla's chunked linear attention against the PyTorch form of the linear mixers (scripts/fla_check.py)"
if [ "$device" = cuda ]; then
    "$py" -c "import fla" 2>/dev/null || "$py" -m pip install --no-index --find-links .device/wheels fla-core einops
    timeout "${ZG_FLA_TIMEOUT:-180}" "$py" scripts/fla_check.py --json "$out/fla_check.json"
    fla_rc=$?
else
    echo "skipped: fla runs only on CUDA"; fla_rc=0
fi

step "accelerator figure: a cached block's busy fraction and step time, prefetching vs in memory (bench/gpu_feed.py)"
feed_args=(--device "$device")
[ "$device" = cpu ] && feed_args+=(--quick)
timeout "${ZG_FEED_TIMEOUT:-240}" "$py" bench/gpu_feed.py "${feed_args[@]}" 2> "$out/gpu_feed.err"
feed_rc=$?
[ "$feed_rc" = 0 ] || tail -20 "$out/gpu_feed.err"

step "default experiment, device=$device"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 2 > "$out/nvidia_smi.csv" &
    smi=$!
fi
args=(--module workflows RunExperiment --local-scheduler --set "device=$device")
[ -n "${ZG_PRESET:-}" ] && args+=(--preset "$ZG_PRESET")
start=$(date +%s)
timeout "${ZG_RUN_TIMEOUT:-420}" "$py" -m luigi "${args[@]}"
run_rc=$?
echo "luigi exit code $run_rc after $(( $(date +%s) - start )) s"
[ -n "${smi:-}" ] && kill "$smi"

report=$(find outputs/Evaluate -name report.json -newer "$gguf" -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -1 | cut -d' ' -f2)
if [ -n "$report" ]; then
    cp "$report" "$(dirname "$report")/report.md" "$out/" 2>/dev/null
    "$py" -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps(r.get('cross_entropy'), indent=1)); print('gates', json.dumps(r.get('gates')))" "$report"
fi
if [ "$run_rc" = 0 ]; then  # the experiment is built: bench/mfu.py only reads its report's table
    step "compute utilisation per phase (bench/mfu.py, the table docs/performance.md shows for the CPU)"
    mfu_args=(--outputs outputs --set "device=$device")
    [ -n "${ZG_PRESET:-}" ] && mfu_args+=(--preset "$ZG_PRESET")
    timeout 120 "$py" bench/mfu.py "${mfu_args[@]}" | tee "$out/mfu.txt"
fi
step "done: tests rc=$tests_rc, fla check rc=$fla_rc, feed figure rc=$feed_rc, experiment rc=$run_rc"
[ "$tests_rc" = 0 ] && [ "$fla_rc" = 0 ] && [ "$run_rc" = 0 ]
