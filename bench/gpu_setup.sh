#!/usr/bin/env bash
# On the GPU machine, which has no network: install the wheels `make gpu-kit` downloaded (carried in
# gpu-kit/wheels with the tree) into gpu-kit/site, beside the image's own packages, and check that
# art-server and bench/gpu.py import there. Then, in the same shell command:
#
#     PYTHONPATH=$PWD/gpu-kit/site python3 bench/gpu.py
#
# PYTHONPATH puts these ahead of the image's site-packages (pydantic needs a newer typing-extensions
# than the image may have), and art-server, started by the bench as a subprocess, inherits it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=gpu-kit/wheels
SITE=$PWD/gpu-kit/site

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_setup: no wheels in $WHEELS: run 'make gpu-kit' on a machine with a network, and carry $WHEELS" >&2
    exit 1
fi
# --no-deps: the kit is the whole closure of what the image lacks; pip would otherwise look for the
# image's own packages (anyio, httpx, ...) in an index that is not there.
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
PYTHONPATH=$SITE "$PY" - <<'EOF'
import torch, transformers, peft
import server.app, server.cli, server.engine.constraints, llguidance  # art-server, and what it imports per request
import bench.gpu
print(f"gpu_setup: art-server and bench/gpu.py import; torch {torch.__version__} (CUDA {torch.cuda.is_available()}), "
      f"transformers {transformers.__version__}, peft {peft.__version__}")
EOF
echo "gpu_setup: done; run with PYTHONPATH=$SITE"
