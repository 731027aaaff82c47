"""The tree holds no leftovers of a merge: no conflict markers in any source or document."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("<<<<<<< ", ">>>>>>> ", "=======\n")


def test_no_conflict_markers():
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".c", ".h", ".toml", ".yaml", ".yml", ".sh"}:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(True), 1):
            if line.startswith(MARKERS[:2]) or line == MARKERS[2]:
                bad.append(f"{name}:{n}")
    assert not bad, bad
