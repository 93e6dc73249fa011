#!/usr/bin/env bash
# On a GPU host without network access: write the synthetic checkpoints of ANCHORS.md, run the GPU tests,
# and benchmark the cuda lane on each shape, writing everything to the folder given.
#
#   benchmarks/gpu.sh OUT_DIR [SHAPE:MIX ...]
#   FUSELANE_KNOBS="activations=dequant" benchmarks/gpu.sh OUT_DIR   (the benchmark and explain at those knobs)
#   FUSELANE_SKIP_TESTS=1 benchmarks/gpu.sh OUT_DIR                   (the benchmark alone)
#   FUSELANE_COMMIT=abc1234 benchmarks/gpu.sh OUT_DIR                   (the commit to record, where the tree
#                                                                       was copied without an up-to-date .git)
#
# Runs from the source tree (PYTHONPATH=src). Wheels of missing pure-Python packages may be put in .whl/
# (gguf, jinja2, rich, pytest, hypothesis, ...): they are installed into a private folder first.
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUT_DIR [SHAPE:MIX ...]}
shift
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=benchmarks/source_tree.sh
source "$root/benchmarks/source_tree.sh"
models=${FUSELANE_MODELS:-/tmp/fuselane-models}
mkdir -p "$models"
specs=("$@")
# ANCHORS.md's four shapes, a mixture with shared experts and latent attention, whose decode launches (the
# kept and the folded shared experts' products) no dense shape runs, and a 7B in llama.cpp's IQ3_M recipe (the
# grid GEMV and the grid embedding gather)
[ ${#specs[@]} -gt 0 ] || specs=(qwen2.5-0.5b:q4_k_m_05b qwen3-0.6b:q8_0 qwen2.5-7b:q4_k_m qwen3-8b:q4_k_m
  deepseek-v2-lite:q4_k_m qwen2.5-7b:iq3_m)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
if [ -n "${FUSELANE_COMMIT:-}" ]; then
  echo "$FUSELANE_COMMIT" > "$out/commit.txt"
else
  git rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || echo unknown > "$out/commit.txt"
fi

for spec in "${specs[@]}"; do
  shape=${spec%%:*} mix=${spec##*:}
  [ -f "$models/$shape-$mix.gguf" ] || python3 -m fuselane.gguf.synth "$models/$shape-$mix.gguf" --shape "$shape" \
    --mix "$mix"
done

# the slowest tests' times go in the log: the anchor-shape tests (tests/cuda/test_anchor_shapes.py) spend most
# of theirs in the host's f64 reference, and this shows how much
[ -n "${FUSELANE_SKIP_TESTS:-}" ] || python3 -m pytest -q -m cuda --durations=20 tests 2>&1 | tee "$out/tests.log"

knobs=()
for knob in ${FUSELANE_KNOBS:-}; do knobs+=(--knob "$knob"); done
for spec in "${specs[@]}"; do
  name=${spec%%:*}-${spec##*:}  # a shape in several mixes: a file each
  python3 -m fuselane bench "$models/$name.gguf" --lane cuda -p 512 -n 128 --depth 0 4096 --json "${knobs[@]}" \
    > "$out/bench-$name.json" 2> "$out/bench-$name.err"
  python3 -m fuselane explain "$models/$name.gguf" --lane cuda "${knobs[@]}" > "$out/explain-$name.txt" 2>&1
done
cat "$out"/bench-*.json
