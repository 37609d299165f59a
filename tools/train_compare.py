"""Train a byte-level GPT-2 through every stage with a backward pass, through SDPA's flash,
cuDNN and memory-efficient backends and through the negative control (a backward wrong in dQ),
from each of several seeds (flashlab.model.training_comparison: SDPA's curves of a seed against
each other are the spread a stage's curve of that seed is judged within, the median over seeds
the verdict), then time a few steps of a larger model where attention is a larger share of a
step (model.TIMED), every implementation's at once, a step of each in turn; records
data/training.csv and draws data/figures/training.png.
Usage (on a GPU): python tools/train_compare.py [STEPS [SEEDS [RUNS]]]   (SEEDS 0: the timed
steps alone, the loss comparison recorded before left as it is)"""
import sys

import pandas as pd
import torch

from flashlab import model, plots, tables

steps = int(sys.argv[1]) if len(sys.argv) > 1 else model.TRAIN["steps"]
seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
runs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
df, match = model.training_comparison(steps=steps, seeds=seeds, runs=runs, with_control=seeds > 0)
with pd.option_context("display.width", 200, "display.float_format", "{:.6g}".format):
    if seeds > 0:
        print(match.to_string(index=False))
    else:  # one seed of a few steps is no loss comparison: its 'within' would be noise
        print("the timed steps alone: no loss comparison made; the one recorded before (data/training.csv):")
        print(tables.training_match().to_string(index=False))
    print(tables.training_step_times(df).to_string())
print("figure:", plots.save_training())
