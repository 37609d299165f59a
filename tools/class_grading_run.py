"""Grade a small class on this machine's GPU, as an instructor does, and say how long each
hand-in took: the throughput TEACHING.md quotes.

    python tools/class_grading_run.py --through 13 --from 09 --out /tmp/class

writes the assignment's edition, makes two hand-ins of it (`solution`: the solution's notebooks
and kernels, every answer right; `blank`: the edition as handed out), grades them with
`flashlab grade --class` (in turn, one at a time: what one GPU does) and prints the gradebook's
totals and the seconds per hand-in. The first hand-in of an assignment also compiles its
stages; the timings say which ones built and which came from the extension cache.
"""
import argparse
import csv
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashlab.course import grade, student  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--through", required=True)
    ap.add_argument("--from", dest="first", required=True)
    ap.add_argument("--out", default="/tmp/class")
    args = ap.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    edition = out / "edition"
    print(student.write(edition, through=args.through, first=args.first), flush=True)
    man = student.read_manifest(edition)
    stages = sorted({e["stage"] for e in man["exercises"]})
    handins = out / "handins"
    for name in ("solution", "blank"):
        (handins / name).mkdir(parents=True)
    for slug in stages:
        for kind, where in (("notebooks", ".ipynb"), ("kernels", ".cu")):
            src = ROOT / kind / f"{slug}{where}"
            if src.is_file():
                shutil.copyfile(src, handins / "solution" / src.name)
                shutil.copyfile(edition / kind / src.name, handins / "blank" / src.name)
    times = {}
    for name in ("solution", "blank"):
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "flashlab", "grade", "--class", str(handins),
                        "--edition", str(edition), "--student", name, "--out",
                        str(out / "grades")], check=True, cwd=str(ROOT))
        times[name] = time.monotonic() - t
    with open(out / "grades" / grade.GRADEBOOK, newline="") as f:
        rows = list(csv.DictReader(f))
    print("\nexercise              solution            blank")
    for ex in [e["id"] for e in man["exercises"]]:
        cells = []
        for who in ("solution", "blank"):
            r = next(r for r in rows if r["student"] == who and r["exercise"] == ex)
            cells.append(f"{float(r['points']):g}/{r['max_points']} {r['verdict']:<8}")
        print(f"{ex:<22}{cells[0]:<20}{cells[1]}")
    for who in ("solution", "blank"):
        mine = [r for r in rows if r["student"] == who]
        total = sum(float(r["points"]) for r in mine)
        most = sum(float(r["max_points"]) for r in mine)
        print(f"{who}: {total:g} / {most:g} points, graded in {times[who]:.0f} s "
              f"(assignment {man['assignment']}, {len(stages)} stages, {len(mine)} exercises)")


if __name__ == "__main__":
    main()
