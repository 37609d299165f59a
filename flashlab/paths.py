"""Where flashlab keeps things. FLASHLAB_DATA points the results table somewhere else (tests do)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
NOTEBOOKS = ROOT / "notebooks"


def data_dir() -> Path:
    return Path(os.environ.get("FLASHLAB_DATA", ROOT / "data"))


def results_csv() -> Path:
    return data_dir() / "results.csv"


def checks_csv() -> Path:
    return data_dir() / "checks.csv"


def peaks_csv() -> Path:
    return data_dir() / "peaks.csv"


def sass_csv() -> Path:
    return data_dir() / "sass.csv"


def figures_dir() -> Path:
    return data_dir() / "figures"


def runs_dir() -> Path:
    return data_dir() / "runs"
