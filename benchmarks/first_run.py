"""Time to the first streamed token of `graphir run`, from process start, with a cold and a warm numba cache.

    python benchmarks/first_run.py                      # README's first command, 3 warm runs
    python benchmarks/first_run.py --warm 5 -- -p "Hi there you all" -n 4 --backend cpu

Each run is a new `graphir` process (the CLI entry point beside this interpreter). The clock starts
just before the process is spawned and stops when stdout shows the first byte after the echoed
prompt, which is the first generated token's text. The first run gets an empty NUMBA_CACHE_DIR and
GRAPHIR_CACHE_DIR (passed graphs, stacked and repacked weights), as the first run after an install
meets them; the warm runs reuse them. PYTHONDONTWRITEBYTECODE is unset, so warm runs find graphir's
bytecode beside its sources as after `pip install` (which compiles it); an environment that sets it
would otherwise compile graphir's sources in every run (~0.1 s). Also reported: when the compile
note reached stderr, and the whole process's wall time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

README_ARGS = ["-p", "The capital of France is", "-n", "24"]


def one_run(cmd: list[str], prompt: str, env: dict[str, str]) -> dict[str, float | None]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    note_s: list[float] = []
    err: list[bytes] = []

    def read_err() -> None:
        for line in proc.stderr:
            if b"compiling CPU kernels" in line and not note_s:
                note_s.append(time.perf_counter() - t0)
            err.append(line)

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out = b""
    first_s = None
    want = prompt.encode()
    while True:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        out += chunk
        if first_s is None and want in out and len(out) > out.index(want) + len(want):
            first_s = time.perf_counter() - t0
    rc = proc.wait()
    total_s = time.perf_counter() - t0
    reader.join()
    if rc != 0:
        sys.exit(f"{' '.join(cmd)} exited {rc}:\n{b''.join(err).decode(errors='replace')[-2000:]}")
    return {"first_token_s": first_s, "note_s": note_s[0] if note_s else None, "total_s": total_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=3, help="warm-cache runs after the cold one")
    ap.add_argument("--cache-dir", default=None, help="NUMBA_CACHE_DIR to use (default: a fresh temporary one)")
    ap.add_argument("--keep-bytecode-env", action="store_true",
                    help="leave PYTHONDONTWRITEBYTECODE as the environment has it")
    ap.add_argument("--installed-cache", action="store_true",
                    help="leave NUMBA_CACHE_DIR unset: numba's own place (__pycache__ beside the installed sources), "
                         "as after `pip install .`; every run is labelled warm, so empty that place first")
    ap.add_argument("run_args", nargs="*", help="arguments of `graphir run` (after --); default: README's")
    a = ap.parse_args()
    run_args = a.run_args or README_ARGS
    prompt = run_args[run_args.index("-p") + 1]
    graphir = Path(sys.executable).with_name("graphir")
    cmd = [str(graphir), "run", *run_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fresh = not (a.cache_dir or a.installed_cache)
    tmp = tempfile.mkdtemp(prefix="numba-cache-") if fresh else a.cache_dir
    if tmp:
        env["NUMBA_CACHE_DIR"] = tmp
    else:
        env.pop("NUMBA_CACHE_DIR", None)
    own = tempfile.mkdtemp(prefix="graphir-cache-")  # fresh runs: graphir's own cache starts empty too
    if fresh:
        env["GRAPHIR_CACHE_DIR"] = own
    if not a.keep_bytecode_env:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    print(f"command: {' '.join(cmd)}   NUMBA_CACHE_DIR={tmp or '(unset)'}   "
          f"GRAPHIR_CACHE_DIR={env.get('GRAPHIR_CACHE_DIR', '(unset)')}   "
          f"PYTHONDONTWRITEBYTECODE={env.get('PYTHONDONTWRITEBYTECODE', '(unset)')}")
    try:
        for i in range(1 + a.warm):
            r = one_run(cmd, prompt, env)
            label = "cold" if i == 0 and fresh else "run" if a.installed_cache and i == 0 else "warm"
            note = f"   note at {r['note_s']:.2f} s" if r["note_s"] is not None else ""
            print(f"{label}: first token {r['first_token_s']:.2f} s   process {r['total_s']:.2f} s{note}", flush=True)
    finally:
        if fresh:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(own, ignore_errors=True)


if __name__ == "__main__":
    main()
