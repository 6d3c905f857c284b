#!/usr/bin/env bash
# Stage what the GPU check (scripts/device_check.sh) needs on a lent GPU machine that reaches no
# package registry and takes at most 64 MiB of carried files per call:
#   .device/wheels/   the Python packages its image lacks (luigi and its own dependencies, gguf,
#                     fla-core for scripts/fla_check.py)
#   .device/teacher-1/, .device/teacher-2/   the SmolLM2 GGUF (94 MB) split in two halves,
#                     one carried per call
# Run here, from the repository root, after the default teacher was prepared once (any
# `RunExperiment` run, or `python -c "from zgcore import teacher; teacher.materialise('smollm2-135m', 'outputs')"`).
# Usage: scripts/device_stage.sh [PYTHON_VERSION]   (the device image's Python; default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
gguf=outputs/teachers/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
pip=${PIP:-.venv/bin/pip}
[ -f "$gguf" ] || { echo "no $gguf: run the default experiment (or PrepareTeacher) once first" >&2; exit 2; }
rm -rf .device && mkdir -p .device/wheels .device/teacher-1 .device/teacher-2
"$pip" download --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .device/wheels luigi tornado tenacity python-daemon lockfile gguf "python-dateutil<3" six \
    fla-core==0.6.0 einops packaging
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > .device/teacher-1/part
tail -c +$(( half + 1 )) "$gguf" > .device/teacher-2/part
sha256sum "$gguf" | cut -d' ' -f1 > .device/teacher-2/sha256
cmp <(cat .device/teacher-1/part .device/teacher-2/part) "$gguf"
du -sh .device/*
echo "staged. On the device tool:"
echo "  run carry=[.device/teacher-1] command='bash scripts/device_check.sh stash'"
echo "  run carry=[.device/teacher-2, .device/wheels] command='bash scripts/device_check.sh run'"
