"""Facts about the machine a measurement was taken on; every recorded row carries them."""
import functools
import os
import subprocess
from datetime import datetime, timezone

import torch

from .paths import ROOT


def gpu_available() -> bool:
    """True when a CUDA GPU is usable; without one flashlab replays recorded results."""
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """Short hash of the checkout, with '-dirty' when tracked code differs from it; recorded
    outputs (data/, executed notebooks, the README table) do not count, since recording
    writes them. FLASHLAB_COMMIT overrides, for copies of the tree that travel without .git."""
    if os.environ.get("FLASHLAB_COMMIT"):
        return os.environ["FLASHLAB_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!data", ":!notebooks/*.ipynb", ":!README.md"], cwd=ROOT,
                               text=True, capture_output=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def environment(device=None) -> dict:
    """GPU name and compute capability, torch and CUDA versions, commit and time."""
    info = {"gpu": "cpu", "compute_capability": "", "torch": torch.__version__,
            "cuda": torch.version.cuda or "", "commit": commit(), "time": now()}
    if gpu_available():
        device = torch.device("cuda") if device is None else torch.device(device)
        major, minor = torch.cuda.get_device_capability(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["compute_capability"] = f"{major}.{minor}"
    return info
