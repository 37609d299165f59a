#!/usr/bin/env bash
# One device call for the classroom kit: the GPU tests of grading (the solution edition's full
# marks on every kernel exercise, an edition's zero with the first wrong element, 13's lazy
# softmax without its fallback failing, every stage refusing a call autograd would record) and a
# class of two hand-ins graded in turn, timed (tools/class_grading_run.py). Logs go to
# data/runs/ and $OUT. Needs the notebook wheels in .whl/ (../shared/tools/device-kit.sh) and
# FLASHLAB_COMMIT=<sha>; the tree travels without .git, and editions are written from what git
# tracks, so a throwaway repository is made of it first.
# Usage: FLASHLAB_COMMIT=abc [ASSIGNMENTS="09:13 05:06"] bash tools/device_grade.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || exit 1
export PYTHONUNBUFFERED=1 FLASHLAB_COMMIT=${FLASHLAB_COMMIT:?set FLASHLAB_COMMIT}
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p data/runs
git init -q . && git add -A && git -c user.name=device -c user.email=device@localhost commit -qm tree \
  || { echo "no git here"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
log=data/runs/grading-gpu-tests-$stamp.log
echo "== GPU tests of grading and of the autograd guard"
python3 -m pytest -q -rA -m gpu tests/test_student.py tests/test_gpu.py -k "student or autograd" \
  -p no:cacheprovider 2>&1 | tee "$log" | grep -E "passed|failed|PASSED|FAILED|Error" | tail -40
cp "$log" "$OUT/"
for a in ${ASSIGNMENTS:-09:13}; do
  first=${a%%:*}; last=${a##*:}
  clog=data/runs/class-grading-$first-$last-$stamp.log
  echo "== a class of two hand-ins, assignment $first-$last"
  python3 tools/class_grading_run.py --from "$first" --through "$last" --out /tmp/class-$first-$last \
    2>&1 | tee "$clog" | tail -20
  cp /tmp/class-$first-$last/grades/gradebook.csv "data/runs/class-grading-$first-$last-$stamp-gradebook.csv"
  cp "$clog" "$OUT/"
done
tar czf "$OUT/runs.tar.gz" data/runs/*-$stamp*
