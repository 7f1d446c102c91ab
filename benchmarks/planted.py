"""Plant one plausible bug at a time in a copy of this tree and check that the tests named with it fail.

Shared by gpu_planted_bugs.py and cpu_planted_bugs.py, which hold the bugs: (what, source path from the repository
root, text, its buggy replacement, test files, pytest -k). Each bug is applied to a copy of this tree laid out as
installed (backends/ and models/ also inside graphir/) under /tmp; the tests then run against the copy, with its
own graph cache and numba cache (compiled kernels are keyed on their source). A line per bug: CAUGHT (the tests
failed, or crashed after a failure), MISSED (they passed: the tests cannot see this bug), NOT RUN (every test
skipped) or the pytest exit status; `run` exits 1 if any bug was not caught. An edit whose text is no longer in
the source stops it: update the bug with the code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Bug = tuple[str, str, str, str, str, str]


def planted_tree(i: int, path: str, old: str, new: str) -> Path:
    """This tree copied to /tmp/graphir_plant<i>, laid out as installed, with one edit in `path` (and in its
    installed copy under graphir/ for backends/ and models/)."""
    d = Path(f"/tmp/graphir_plant{i}")
    shutil.rmtree(d, ignore_errors=True)
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".snap*", ".whl", ".gpu_carry", "*.egg-info",
                                  ".pytest_cache", ".ruff_cache")
    shutil.copytree(ROOT, d, ignore=skip)
    for pkg in ("backends", "models"):
        if not (d / "graphir" / pkg).exists():
            shutil.copytree(d / pkg, d / "graphir" / pkg)
    copies = [d / path] + ([d / "graphir" / path] if path.startswith(("backends/", "models/")) else [])
    for p in copies:
        text = p.read_text()
        if text.count(old) != 1:
            sys.exit(f"bug {i}: its text occurs {text.count(old)} times in {path}, not once")
        p.write_text(text.replace(old, new))
    return d


def run(bugs: list[Bug], only: set[str]) -> None:
    """Plant each bug (or only the numbered ones), run its tests, print the verdicts; exit 1 if one was missed."""
    missed = 0
    for i, (what, path, old, new, tests, k) in enumerate(bugs):
        if only and str(i) not in only:
            continue
        d = planted_tree(i, path, old, new)
        t0 = time.time()
        path_env = os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")]))  # the copy's graphir first
        env = dict(os.environ, PYTHONPATH=path_env, GRAPHIR_CACHE_DIR=f"{d}/.cache", NUMBA_CACHE_DIR=f"{d}/.numba")
        r = subprocess.run(f"{sys.executable} -m pytest -q -x -p no:cacheprovider {tests} -k '{k}'", shell=True,
                           cwd=d, env=env, capture_output=True, text=True)
        last = (r.stdout.strip().splitlines() or ["?"])[-1]
        ran = " passed" in last or " failed" in last  # all skipped proves nothing
        verdict = {1: "CAUGHT", 0: "MISSED"}.get(r.returncode, f"pytest exit {r.returncode}") if ran else "NOT RUN"
        if r.returncode < 0 or r.returncode >= 128:  # killed by a signal (a write out of bounds): loud too
            verdict = "CAUGHT" if " failed" in last else f"crashed ({r.returncode})"
        print(f"{i}: {verdict:7s} {what}: {last} ({time.time() - t0:.0f} s)", flush=True)
        missed += verdict not in ("CAUGHT", "NOT RUN")
    sys.exit(1 if missed else 0)
