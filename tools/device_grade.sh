#!/usr/bin/env bash
# One device call for the classroom kit: the GPU tests of grading (the solution edition's full
# marks on every kernel exercise, an edition's zero with the first wrong element, 13's lazy
# softmax without its fallback failing, every stage refusing a call autograd would record) and a
# class of two hand-ins graded in turn, timed (tools/class_grading_run.py). Logs go to
# data/runs/ and $OUT. Needs the notebook wheels in .whl/ (../shared/tools/device-kit.sh) and
# FLASHLAB_COMMIT=<sha>; the tree travels without .git, and editions are written from what git
# tracks, so a throwaway repository is made of it first.
# Usage: FLASHLAB_COMMIT=abc [PHASES="prebuild tests class"] [ASSIGNMENTS="09:13 05:06"] bash tools/device_grade.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || exit 1
export PYTHONUNBUFFERED=1 FLASHLAB_COMMIT=${FLASHLAB_COMMIT:?set FLASHLAB_COMMIT}
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p data/runs
git init -q . && git add -A && { git diff --cached --quiet && git rev-parse -q --verify HEAD >/dev/null \
  || git -c user.name=device -c user.email=device@localhost commit -qm tree; } || { echo "no git here"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
for phase in ${PHASES:-prebuild tests class}; do case $phase in
  prebuild)
    echo "== prebuild: every stage, solved and as the whole course's edition hands it out"
    python3 - <<'PY'
import concurrent.futures as cf, tempfile, time
from pathlib import Path
import torch
from flashlab import build, paths
from flashlab.stages import stages
from flashlab.course import student
cc = torch.cuda.get_device_capability()
course = Path(tempfile.mkdtemp()) / "course"
student.write(course)
jobs = [(str(st.source), st.arch(cc), str(paths.KERNELS)) for st in stages()]
jobs += [(str(course / "kernels" / f"{st.slug}.cu"), st.arch(cc), str(course / "kernels"))
         for st in stages() if st.number >= 2]
def one(job):
    t = time.monotonic()
    build.build_module(job[0], arch=job[1], include_dir=job[2])
    return f"{Path(job[0]).parent.parent.name}/{Path(job[0]).name}: {time.monotonic() - t:.0f} s"
t = time.monotonic()
with cf.ProcessPoolExecutor(8) as ex:
    for line in ex.map(one, jobs):
        print(line, flush=True)
print(f"prebuilt {len(jobs)} modules in {time.monotonic() - t:.0f} s")
PY
    ;;
  tests)
    log=data/runs/grading-gpu-tests-$stamp.log
    echo "== GPU tests of grading and of the autograd guard"
    python3 -m pytest -q -rA -m gpu tests/test_student.py tests/test_gpu.py -k "${TEST_K:-student or autograd}" \
      -p no:cacheprovider 2>&1 | tee "$log" | grep -E "passed|failed|PASSED|FAILED|Error" | tail -40
    cp "$log" "$OUT/" ;;
  class)
    for a in ${ASSIGNMENTS:-09:13}; do
      first=${a%%:*}; last=${a##*:}
      clog=data/runs/class-grading-$first-$last-$stamp.log
      echo "== a class of two hand-ins, assignment $first-$last"
      python3 tools/class_grading_run.py --from "$first" --through "$last" --out /tmp/class-$first-$last \
        2>&1 | tee "$clog" | tail -20
      cp /tmp/class-$first-$last/grades/gradebook.csv "data/runs/class-grading-$first-$last-$stamp-gradebook.csv"
      cp "$clog" "$OUT/"
    done ;;
esac; done
tar czf "$OUT/runs.tar.gz" data/runs/*-$stamp*
