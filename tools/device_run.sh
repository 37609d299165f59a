#!/usr/bin/env bash
# The recorded run: `flashlab run` on the device, then pack data/ into $OUT for the trip back.
# Usage (device): FLASHLAB_COMMIT=<sha> bash tools/device_run.sh [flashlab run args...]
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git rev-parse --short=10 HEAD 2>/dev/null && export FLASHLAB_COMMIT=$(git rev-parse --short=10 HEAD)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)
echo "commit: ${FLASHLAB_COMMIT:-unknown}"
python3 -m flashlab run --no-progress "$@" 2>&1 | tee "$OUT/run.log"
tar czf "$OUT/data.tar.gz" data
