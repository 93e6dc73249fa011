# Sourced by the GPU host's scripts (`gpu.sh`, `llama_cpp.sh`): run from the source tree at `root`, the wheels of
# missing pure-Python packages in .whl/ (gguf, jinja2, rich, pytest, ...) installed into a private folder first.
cd "$root" || exit 1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fuselane-site .whl/*.whl
  export PYTHONPATH=/tmp/fuselane-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$root/src:$root:${PYTHONPATH:-} PYTHONUNBUFFERED=1
