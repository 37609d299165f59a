#!/usr/bin/env bash
# The recorded run on the GPU machine. Phases, in the order given (default: tests run notebooks):
#   tune       stage 08's autotune (flashlab tune), data/tune08.csv; apply it at home with
#              `flashlab tune --apply` and commit before recording the run
#   tests      the GPU tests (checks, bad input, compute-sanitizer), log in data/runs/
#   run        flashlab run (RUN_ARGS, e.g. "--profile --stage 05"): stages and baselines, figures, README
#   again      a second, separate flashlab run --no-sweep into a scratch data/ (its log and table
#              go to data/runs/), then `flashlab bench sdpa_cudnn --dtype fp16` on its own: three
#              timings of the same baseline to compare
#   model      GPT-2 from its config with SDPA, eager and each fast stage as attention (data/model.csv)
#   minimal    stage 01 beside the published flash-attention-minimal kernel (tools/compare_minimal.py;
#              MINIMAL_CHECKOUT: a checkout of it, carried, never committed), data/minimal.csv
#   notebooks  every notebook executed live, outputs saved; figures and README regenerated
# data/, the notebooks and README go back packed in $OUT/bundle.tar.gz. Needs the notebook wheels
# in .whl/ (../shared/tools/device-kit.sh) and FLASHLAB_COMMIT=<sha>, since the tree travels
# without .git. Usage: FLASHLAB_COMMIT=abc bash tools/device_record.sh [tests] [run] [notebooks]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} \
  && python3 -m ipykernel install --user --name python3 >/dev/null || exit 1
export PYTHONUNBUFFERED=1 FLASHLAB_COMMIT=${FLASHLAB_COMMIT:?set FLASHLAB_COMMIT}
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p data/runs
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
for phase in "${@:-tests run again notebooks}"; do for p in $phase; do case $p in
  tune)
    echo "== stage 08 autotune"
    python3 tools/tune08.py 2>&1 | grep -v Warning | tee "data/runs/tune08-$stamp.log" | tail -6 ;;
  tests)
    echo "== GPU tests"
    # TEST_ARGS is read as shell words, quotes included: TEST_ARGS='tests/test_gpu.py -k "11 or 12"'
    eval "python3 -m pytest -q -rP -m gpu ${TEST_ARGS:-tests} -p no:cacheprovider" 2>&1 \
      | tee "data/runs/gpu-tests-$stamp.log" | tail -4 ;;
  run)
    echo "== flashlab run ${RUN_ARGS:-}"
    # RUN_ARGS, e.g. "--stage 04 --stage 05", splits a long run over several device calls
    python3 -m flashlab run --no-progress ${RUN_ARGS:-} > "$OUT/run.out" 2>&1
    echo "flashlab run exit $?"
    tail -16 "$OUT/run.out" ;;
  again)
    echo "== a second flashlab run (teaching configs, scratch data), and a separate re-time"
    rm -rf /tmp/again && mkdir -p /tmp/again
    FLASHLAB_DATA=/tmp/again python3 -m flashlab run --no-progress --no-sweep > "data/runs/again-$stamp.log" 2>&1
    echo "second run exit $?"
    cp /tmp/again/results.csv "data/runs/again-$stamp-results.csv"
    FLASHLAB_DATA=/tmp/again python3 -m flashlab bench sdpa_cudnn --dtype fp16 2>&1 | tee "data/runs/retime-$stamp.log"
    python3 - "$stamp" <<'PY'
import sys
import flashlab as fl
from flashlab import tables
cudnn = lambda df: tables.at_config(df[df.stage == "sdpa_cudnn"], fl.teaching("fp16"))
gpu = fl.gpu_shown()
first = cudnn(tables.recorded(gpu=gpu))
second = cudnn(tables.RESULTS.load(f"data/runs/again-{sys.argv[1]}-results.csv"))
print(f"sdpa_cudnn fp16 teaching on {gpu}, TFLOP/s: run 1 {first.tflops.round(1).tolist()}, "
      f"run 2 {second.tflops.round(1).tolist()} (re-timed {first.retimes.tolist()}, {second.retimes.tolist()})")
PY
    ;;
  model)
    echo "== GPT-2 with each attention (flashlab model)"
    python3 -m flashlab model 2>&1 | grep -v Warning | tee "data/runs/model-$stamp.log" | tail -16 ;;
  minimal)
    echo "== stage 01 beside the published kernel"
    python3 tools/compare_minimal.py "${MINIMAL_CHECKOUT:?set MINIMAL_CHECKOUT}" 2>&1 \
      | tee "data/runs/minimal-$stamp.log" | tail -8 ;;
  notebooks)
    echo "== notebooks (live)"
    # NB_ARGS, e.g. "00 01 02 03 04", splits the notebooks over several device calls
    python3 tools/notebooks.py execute ${NB_ARGS:-} 2>&1 | grep -v "WARNING | Kernel is running over TCP" \
      | tee "data/runs/notebooks-$stamp.log" | tail -8
    python3 -m flashlab plot >/dev/null && python3 -m flashlab readme ;;
  *) echo "unknown phase $p"; exit 2 ;;
esac; done; done
rm -f data/*.lock
tar czf "$OUT/bundle.tar.gz" data notebooks/*.ipynb README.md
echo "== done"
