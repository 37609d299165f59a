#!/usr/bin/env bash
# One device call: GPU tests named by $TESTS (pytest -k expression; none: skipped), then notebooks
# executed live (saving their outputs), then notebooks/ and data/ packed into $OUT for the trip
# back. Needs the wheels of ../shared/tools/device-kit.sh in .whl/ (run with carry [".whl"]).
# Usage (device): TESTS="variants" bash tools/device_notebooks.sh 10_tma 13_lazy_rescale
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site && python3 -m ipykernel install --user --name python3 >/dev/null || exit 1
# The device's copy of the repository may carry an older .git than its files: pass the commit in
# (FLASHLAB_COMMIT=$(git rev-parse --short=10 HEAD) from a clean checkout) when that matters.
[ -n "${FLASHLAB_COMMIT:-}" ] || export FLASHLAB_COMMIT=$(git rev-parse --short=10 HEAD)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)
echo "commit: ${FLASHLAB_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
if [ -n "${TESTS:-}" ]; then
  python3 -m pytest -q -m gpu tests -k "$TESTS" -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-$stamp.log" | tail -15
fi
for nb in "$@"; do
  t=$(date +%s)
  python3 tools/notebooks.py execute "$nb" 2>&1 | tail -5 | tee -a "$OUT/notebooks-$stamp.log"
  echo "$nb: $(( $(date +%s) - t )) s" | tee -a "$OUT/notebooks-$stamp.log"
done
tar czf "$OUT/back.tar.gz" notebooks/*.ipynb data
