"""Train a byte-level GPT-2 through every stage with a backward pass and through SDPA's flash
(twice: its run-to-run noise) and cuDNN backends, from one seed (flashlab.model.
training_comparison); records data/training.csv and draws data/figures/training.png.
Usage (on a GPU): python tools/train_compare.py [STEPS]"""
import sys

import torch

from flashlab import model, plots

steps = int(sys.argv[1]) if len(sys.argv) > 1 else model.TRAIN["steps"]
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
df, summary = model.training_comparison(steps=steps)
print(summary.to_string(index=False))
print("figure:", plots.save_training())
