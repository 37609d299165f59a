"""Train a byte-level GPT-2 through every stage with a backward pass and through SDPA's flash,
cuDNN and memory-efficient backends, from one seed, several runs of each
(flashlab.model.training_comparison: SDPA's runs against each other are the spread a stage's
curve is judged within), then time a few steps of a larger model where attention is a larger
share of a step (model.TIMED); records data/training.csv and draws data/figures/training.png.
Usage (on a GPU): python tools/train_compare.py [STEPS [RUNS]]"""
import sys

import pandas as pd
import torch

from flashlab import model, plots, tables

steps = int(sys.argv[1]) if len(sys.argv) > 1 else model.TRAIN["steps"]
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
df, match = model.training_comparison(steps=steps, runs=runs)
with pd.option_context("display.width", 200, "display.float_format", "{:.6g}".format):
    print(match.to_string(index=False))
    print(tables.training_step_times(df).to_string())
print("figure:", plots.save_training())
