#!/usr/bin/env bash
# One device call: versions, cold and cached build times, the GPU tests, a quick timing of each stage.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
for s in 01 01; do /usr/bin/time -f "build $s: %e s" python3 -c "import flashlab as fl; fl.stage('$s').build()"; done
python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
for s in 01 02 03; do python3 -m flashlab bench $s; done 2>&1 | tee "$OUT/bench.log"
python3 -m flashlab bench 03 --D 128 --N 4096 --B 4 --H 16
python3 - <<'PY'
import time, flashlab as fl, torch
torch.cuda.init()
for s in ("01", "03"):
    t = time.perf_counter(); fl.stage(s).build(); print(f"in-process build/load of {s}: {time.perf_counter() - t:.2f} s")
PY
