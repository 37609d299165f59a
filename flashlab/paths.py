"""Where flashlab keeps things. FLASHLAB_DATA points data/ somewhere else (tests do); which files
lie there is flashlab.tables' business."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
NOTEBOOKS = ROOT / "notebooks"


def data_dir() -> Path:
    return Path(os.environ.get("FLASHLAB_DATA", ROOT / "data"))


def figures_dir() -> Path:
    return data_dir() / "figures"


def runs_dir() -> Path:
    return data_dir() / "runs"
