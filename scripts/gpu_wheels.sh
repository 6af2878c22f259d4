#!/usr/bin/env bash
# Fetches, as wheels into .whl (or $1), the Python packages scripts/gpu_check.sh needs that a
# GPU machine's own image lacks (the lent H200 boxes have torch, triton, pytest and most of
# the scientific stack, but not the Tinker SDK, the HTTP server's packages or our pins of
# transformers), for its Python ($GPU_PYTHON_VERSION, default 3.12) on manylinux x86-64. Run it
# where pip reaches a package index; gpu_check.sh installs what it finds there with --no-index.
# Keep .whl out of git (`echo /.whl/ >> .git/info/exclude`) and carry it to the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
VERSION=${GPU_PYTHON_VERSION:-3.12}
mkdir -p "$DEST"
# lorafleet's runtime pins (pyproject.toml) that the image lacks or holds at other versions;
# their own dependencies come along, then the ones the image already has are dropped below.
"$PY" -m pip download -q --only-binary=:all: --python-version "$VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DEST" \
  tinker==0.38.0 fastapi==0.165.0 uvicorn==0.54.0 pyrage==1.4.0 gguf==0.19.0 \
  transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0
# In the image already (its package list, /work/.library/device/KINDS.md): dropped, so that
# the carried tree stays small and the image's builds (numpy, protobuf, ...) are used.
for name in anyio certifi charset_normalizer click filelock fsspec h11 hf_xet httpcore httpx \
  idna markdown_it_py mdurl numpy packaging protobuf pygments pyyaml PyYAML regex requests \
  rich shellingham tqdm typer typing_extensions urllib3 annotated_doc; do
  rm -f "$DEST/$name"-[0-9]*.whl
done
du -sh "$DEST"
ls "$DEST"
