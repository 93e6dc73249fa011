#!/usr/bin/env bash
# On a GPU host: llama.cpp's llama-bench and `fuselane bench` on the same synthetic checkpoints, one after the
# other on one card, as ANCHORS.md measured llama.cpp (`-ngl 99 -fa 1 -p 512 -n 128`, a build for sm_90).
#
#   benchmarks/llama_cpp.sh LLAMA_SRC OUT_DIR [SHAPE:MIX[:REGEX=TYPE] ...]
#
# A third field is llama-quantize's --tensor-type over the mix (`qwen2.5-7b:q4_k_m:attn_|ffn_=iq2_xxs`: every
# projection IQ2_XXS).
# LLAMA_SRC is a llama.cpp source tree or `benchmarks/llama_cpp_source.sh`'s .tgz. It is built once into
# LLAMA_BUILD (default /tmp/llama-build; ~4 minutes on 16 cores); a build already there is reused. Each
# checkpoint is written to FUSELANE_MODELS (default /tmp/fuselane-models), measured by both, and removed
# (FUSELANE_KEEP=1 keeps it). OUT_DIR gets each tool's output and side-by-side.md, a table of both and their
# ratios. FUSELANE_BUDGET_S (seconds) stops before a checkpoint once that much time has passed.
set -uo pipefail
src=${1:?usage: benchmarks/llama_cpp.sh LLAMA_SRC OUT_DIR [SHAPE:MIX ...]}
out=${2:?usage: benchmarks/llama_cpp.sh LLAMA_SRC OUT_DIR [SHAPE:MIX ...]}
shift 2
src=$(realpath "$src")
mkdir -p "$out"
out=$(realpath "$out")
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=benchmarks/source_tree.sh
source "$root/benchmarks/source_tree.sh"
build=${LLAMA_BUILD:-/tmp/llama-build}
models=${FUSELANE_MODELS:-/tmp/fuselane-models}
budget=${FUSELANE_BUDGET_S:-0}
start=$(date +%s)
mkdir -p "$models"
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(qwen2.5-7b:q4_k_m qwen2.5-7b:q5_k_m qwen2.5-7b:q6_k qwen2.5-7b:q8_0
  qwen2.5-7b:q3_k_m qwen2.5-7b:q2_k qwen2.5-7b:iq4_xs qwen2.5-1.5b:bf16 qwen2.5-7b:iq3_m qwen2.5-7b:iq3_xxs)

if [ ! -x "$build/bin/llama-bench" ]; then
  tree=$src
  if [ -f "$src" ]; then
    mkdir -p "$build.src" && tar -xzf "$src" -C "$build.src" && tree=$(find "$build.src" -maxdepth 2 -name CMakeLists.txt -printf '%h\n' | head -1)
  fi
  cmake -S "$tree" -B "$build" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$out/llama-build.log" 2>&1 \
    && cmake --build "$build" --target llama-bench -j "$(nproc)" >> "$out/llama-build.log" 2>&1 \
    || { tail -20 "$out/llama-build.log"; exit 1; }
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
git rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || echo unknown > "$out/commit.txt"
table=$out/side-by-side.md
printf '| shape | mix | file GB | llama.cpp pp512 | fuselane pp512 | ratio | llama.cpp tg128 | fuselane tg128 | ratio |\n' > "$table"
printf '|---|---|---:|---:|---:|---:|---:|---:|---:|\n' >> "$table"
for spec in "${specs[@]}"; do
  if [ "$budget" -gt 0 ] && [ $(($(date +%s) - start)) -ge "$budget" ]; then
    echo "stopped before $spec: the budget of $budget s is spent" | tee -a "$table"
    break
  fi
  # SHAPE:MIX, or SHAPE:MIX:REGEX=TYPE for llama-quantize's --tensor-type over the mix (a grid format's file)
  IFS=: read -r shape mix types <<< "$spec"
  name=$(echo "$spec" | tr ':=|()' '-----' | tr -s -)
  extra=()
  [ -z "$types" ] || extra=(--tensor-type "$types")
  file=$models/$name.gguf
  [ -f "$file" ] || python3 -m fuselane.gguf.synth "$file" --shape "$shape" --mix "$mix" "${extra[@]}" > /dev/null
  "$build/bin/llama-bench" -m "$file" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json > "$out/llama-$name.json" 2> "$out/llama-$name.err"
  python3 -m fuselane bench "$file" --lane cuda -p 512 -n 128 -r 3 --json > "$out/fuselane-$name.json" 2> "$out/fuselane-$name.err"
  label=$mix${types:+ + ${types//|/\\|}}  # a regex's | escaped for the markdown table
  python3 "$root/benchmarks/side_by_side.py" "$shape" "$label" "$file" "$out/llama-$name.json" "$out/fuselane-$name.json" | tee -a "$table"
  [ -n "${FUSELANE_KEEP:-}" ] || rm -f "$file"
done
