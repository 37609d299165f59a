# The device call behind training-h200-20261201T0735Z.log
#!/bin/bash
# device call 4: the five-seed loss comparison (300 steps) with stage 23 among the stages, the control, then the timed steps in turn
export PYTHONPATH=$PWD FLASHLAB_COMMIT=$(cat .s22/commit) PYTHONUNBUFFERED=1
T=$(date -u +%Y%m%dT%H%MZ); S=$(date +%s)
mkdir -p $OUT/data/runs $OUT/data/figures
L=$OUT/data/runs/training-h200-$T.log
echo "# python tools/train_compare.py (300 steps, 5 seeds, 1 run each, the negative control among them; then 30 timed steps at seq 4096), commit $FLASHLAB_COMMIT, first run with stage 23 (dK and dV written by the TMA) in the loss comparison" > $L
timeout 60 python3 .s22/prebuild.py 2>&1 | tail -1
timeout 500 python3 tools/train_compare.py 2>&1 | tee -a $L | grep -v "seed . run" | tail -40
echo "rc $? elapsed $(( $(date +%s) - S )) s" | tee -a $L
cp data/training.csv $OUT/data/ ; cp data/figures/training.png $OUT/data/figures/
