# The device call behind backward-18-22-23-{fp16,bf16}-h200-20261201T0708Z.log (.s22/sweep23.py is backward-18-22-23-h200-20261201T0419Z-sweep.py); its GPU-test phase failed to collect (no nbformat on the device) and was run again in call 0714Z
#!/bin/bash
# device call 1: stages 18, 22 and 23 with SDPA's backwards over the FlashAttention sweep, fp16 then
# bf16, in turn (measure.measure_backward), rows recorded in data/results.csv; then stage 23's GPU tests
export PYTHONPATH=$PWD FLASHLAB_COMMIT=$(cat .s22/commit) PYTHONUNBUFFERED=1
T=$(date -u +%Y%m%dT%H%MZ); S=$(date +%s)
mkdir -p $OUT/data/runs
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee $OUT/smi.txt
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
timeout 120 python3 .s22/prebuild.py 2>&1 | tail -3
for dt in fp16 bf16; do
  log=$OUT/data/runs/backward-18-22-23-$dt-h200-$T.log
  echo "# commit $FLASHLAB_COMMIT: python .s22/sweep23.py $dt 18 22 23 (measure.measure_backward over the sweep, stages 18 22 23 and SDPA's backends in turn)" > $log
  t=$(date +%s)
  timeout 260 python3 .s22/sweep23.py $dt 18 22 23 >> $log 2>&1
  echo "measured in $(( $(date +%s) - t )) s" >> $log
  tail -30 $log
  cp data/results.csv $OUT/data/
done
echo "elapsed $(( $(date +%s) - S )) s"
left=$(( 560 - ($(date +%s) - S) ))
if [ $left -gt 60 ]; then
  timeout $left python3 -m pytest -q -m gpu tests -p no:cacheprovider -k "23_tma or dkdv or one_box" 2>&1 | tail -25 | tee $OUT/data/runs/gpu-tests-23-h200-$T.log
fi
echo "END elapsed $(( $(date +%s) - S )) s"
