# The device call behind notebook-23-h200-20261201T0723Z.log
#!/bin/bash
# device call 3: notebook 23 executed live (its outputs come back in a tarball)
export PYTHONPATH=$PWD FLASHLAB_COMMIT=$(cat .s22/commit) PYTHONUNBUFFERED=1
T=$(date -u +%Y%m%dT%H%MZ); S=$(date +%s)
mkdir -p $OUT/data/runs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site && python3 -m ipykernel install --user --name python3 >/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv
echo "commit $FLASHLAB_COMMIT" > $OUT/data/runs/notebook-23-h200-$T.log
t=$(date +%s); timeout 400 python3 tools/notebooks.py execute 23_tma_store_backward 2>&1 | grep -v IPKernelApp | tail -5 | tee -a $OUT/data/runs/notebook-23-h200-$T.log
echo "23_tma_store_backward: $(( $(date +%s) - t )) s" | tee -a $OUT/data/runs/notebook-23-h200-$T.log
tar czf $OUT/back.tar.gz notebooks/23_tma_store_backward.ipynb data/profile.csv data/results.csv data/figures
echo "END elapsed $(( $(date +%s) - S )) s"
