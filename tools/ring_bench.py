"""Ring attention across this machine's GPUs with a flashlab stage as local attention, beside
PyTorch's context_parallel with SDPA's cuDNN and flash backends, timed in one run
(flashlab.ring.measure): forward and training step (forward and backward) per sequence length,
dtype and mask; the ring's compute alone and communication alone (the share hidden); one GPU's
time up to --single-up-to tokens (the scaling efficiency). Rows to data/ring.csv (rank 0).

Usage (one process per GPU):
  torchrun --nproc-per-node=G tools/ring_bench.py [--lengths 32768,131072,...] [--stage NN]
      [--dtypes fp16,bf16] [--heads 16] [--runs 10] [--single-up-to 262144] [--no-record]
"""
import argparse
import os

import torch
import torch.distributed as dist

import flashlab as fl
from flashlab import ring

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--lengths", default="32768,131072,524288,1048576")
p.add_argument("--stage", default=None,
               help="the local attention (default: the last stage with a backward pass)")
p.add_argument("--dtypes", default="fp16,bf16")
p.add_argument("--heads", type=int, default=16)
p.add_argument("--runs", type=int, default=10)
p.add_argument("--single-up-to", type=int, default=262144)
p.add_argument("--baselines", default="sdpa_cudnn,sdpa_flash")
p.add_argument("--no-record", action="store_true")
args = p.parse_args()

local_rank = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
try:
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} x {torch.cuda.get_device_name()}  torch {torch.__version__}  "
              f"CUDA {torch.version.cuda}  stage {args.stage or 'the last with a backward'}", flush=True)
    ring.measure(args.stage and fl.stage(args.stage).slug, lengths=[int(n) for n in args.lengths.split(",")],
                 dtypes=args.dtypes.split(","), heads=args.heads, runs=args.runs,
                 single_up_to=args.single_up_to,
                 baselines=[b for b in args.baselines.split(",") if b],
                 record=not args.no_record, log=lambda s: print(s, flush=True))
finally:
    dist.destroy_process_group()
