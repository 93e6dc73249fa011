#!/usr/bin/env bash
# On a machine with network access: the llama.cpp source that ANCHORS.md's figures were measured with (the tree vendored
# in llama-cpp-python's source release), pruned to what a CUDA build of llama-bench needs, as one .tgz that a GPU
# host without network access can take (`benchmarks/llama_cpp.sh` builds and runs it there).
#
#   benchmarks/llama_cpp_source.sh OUT.tgz [LLAMA_CPP_PYTHON_VERSION]   (default 0.3.36: llama.cpp of 2026-10-01)
#
# The release is ~77 MB; the pruned tree ~27 MB, ~5 MB compressed: docs, models, tests, examples, the web UI and
# the other backends' sources go.
set -euo pipefail
out=${1:?usage: benchmarks/llama_cpp_source.sh OUT.tgz [VERSION]}
version=${2:-0.3.36}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
skip=(docs models media tests examples benches gguf-py conversion scripts tools/ui tools/server)
for b in virtgpu cann openvino webgpu et metal hexagon sycl vulkan opencl; do skip+=("ggml/src/ggml-$b"); done
for d in "${skip[@]}"; do rm -rf "${src:?}/$d"; done
mv "$src" "$work/llama.cpp"
tar -czf "$out" -C "$work" llama.cpp
echo "$out: llama.cpp of llama-cpp-python $version, $(du -h "$out" | cut -f1)"
