# The device call behind gpu-tests-23-h200-20261201T0714Z.log, notebook-23-h200-20261201T0714Z.log (the notebook did not come back: executed again later) and training-steps-h200-20261201T0714Z.log
#!/bin/bash
# device call 2: stage 23's GPU tests (checks, grading of 23.dkdv_boxes, the ring with stage 23), notebook 23 executed, training steps in turn
export PYTHONPATH=$PWD FLASHLAB_COMMIT=$(cat .s22/commit) PYTHONUNBUFFERED=1
T=$(date -u +%Y%m%dT%H%MZ); S=$(date +%s)
mkdir -p $OUT/data/runs $OUT/data/figures $OUT/notebooks
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site && python3 -m ipykernel install --user --name python3 >/dev/null
timeout 60 python3 .s22/prebuild.py 2>&1 | tail -1
timeout 200 python3 -m pytest -q -rA -m gpu tests -p no:cacheprovider -k "23_tma or dkdv or one_box or test_ring" 2>&1 | grep -E "PASSED|FAILED|SKIPPED|passed|failed|Error" | tail -70 | tee $OUT/data/runs/gpu-tests-23-h200-$T.log
echo "elapsed $(( $(date +%s) - S )) s"
t=$(date +%s); timeout 150 python3 tools/notebooks.py execute 23_tma_store_backward 2>&1 | tail -5 | tee $OUT/data/runs/notebook-23-h200-$T.log
echo "23_tma_store_backward: $(( $(date +%s) - t )) s" | tee -a $OUT/data/runs/notebook-23-h200-$T.log
cp notebooks/23_tma_store_backward.ipynb $OUT/notebooks/; cp -r data $OUT/nbdata
echo "elapsed $(( $(date +%s) - S )) s"
left=$(( 570 - ($(date +%s) - S) ))
timeout $left python3 tools/train_compare.py 30 0 1 2>&1 | tee $OUT/data/runs/training-steps-h200-$T.log | tail -20
cp data/training.csv $OUT/data/ ; cp data/figures/training.png $OUT/data/figures/
echo "END elapsed $(( $(date +%s) - S )) s"
