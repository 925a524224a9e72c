"""The repository stands alone: no file points outside it, and every relative link in its docs resolves."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("../" + "shared", "DESIGN" + ".md")  # split so this file does not match itself


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = [ROOT / n for n in names if not n.endswith(".png")]
    return [f for f in files if f.is_file()]


def test_no_file_points_outside_the_repository():
    offenders = [f"{f.relative_to(ROOT)}: {needle}" for f in tracked_text_files()
                 for needle in OUTSIDE if needle in f.read_text(errors="ignore")]
    assert not offenders


def test_relative_links_in_docs_resolve():
    broken = []
    for doc in [f for f in tracked_text_files() if f.suffix == ".md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+:", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken
