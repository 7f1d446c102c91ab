"""Every kernel source of the gpu backend compiles for both vendors, with no GPU present.

CUDA: NVRTC (through CuPy's bindings, which need no device) for sm_80 and sm_90.
HIP: Debian's hipcc (ROCm 5.2) for gfx90a (wavefront 64) and gfx1030 (wavefront 32).
Each file is compiled with exactly the options the backend uses (kernels.SOURCES), so what
passes here is what the backend would load at run time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from graphir.backends.gpu import kernels

from graphir import flags

SOURCES = sorted(kernels.SOURCES)
# CI sets this: there a missing compiler is a failure, not a skip (.ci/run installs both)
REQUIRE = flags.enabled("GRAPHIR_REQUIRE_KERNEL_COMPILERS")


def _missing(what: str) -> None:
    (pytest.fail if REQUIRE else pytest.skip)(what)


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # no CuPy, or the NVRTC library itself is missing
        _missing(f"NVRTC not loadable here ({type(e).__name__}); pip install -e '.[test]' brings it")
    return nvrtc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_with_nvrtc(name, arch):
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(kernels.source(name), name, [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", *kernels.nvrtc_options(kernels.SOURCES[name])])
    except nvrtc.NVRTCError:
        pytest.fail(f"{name} for {arch}:\n{nvrtc.getProgramLog(prog)}")
    assert len(nvrtc.getCUBIN(prog)) > 0
    log = nvrtc.getProgramLog(prog)
    assert "warning" not in log, f"{name} for {arch} compiles with warnings:\n{log}"


@pytest.mark.parametrize("arch", ["gfx90a", "gfx1030"])
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_with_hipcc(name, arch, tmp_path):
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        _missing("hipcc not installed (apt-get install hipcc; .ci/run does)")
    defines = [f"-D{d}" for d in kernels.SOURCES[name]]
    cmd = [hipcc, "--genco", f"--offload-arch={arch}", f"-I{kernels.KERNEL_DIR}", "-std=c++17", *defines, "-x", "hip",
           str(kernels.KERNEL_DIR / name), "-o", str(tmp_path / "k.co")]
    r = subprocess.run(cmd, env={**os.environ, "HIP_PLATFORM": "amd"}, capture_output=True, text=True)
    assert r.returncode == 0, f"{name} for {arch}:\n{r.stderr}"
    assert (tmp_path / "k.co").stat().st_size > 0


def test_every_source_is_listed():
    on_disk = {p.name for p in kernels.KERNEL_DIR.glob("*.cu")}
    assert on_disk == set(kernels.SOURCES), "kernels.SOURCES must list exactly the .cu files beside it"


def _entries(name: str, defines: tuple[str, ...]) -> set[str]:
    """The kernels (PTX entries) of source `name` compiled with `defines`, checked free of warnings."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(kernels.source(name), name, [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_90", *kernels.nvrtc_options(defines)])
    except nvrtc.NVRTCError:
        pytest.fail(f"{name} with {defines}:\n{nvrtc.getProgramLog(prog)}")
    log = nvrtc.getProgramLog(prog)
    assert "warning" not in log, f"{name} with {defines} compiles with warnings:\n{log}"
    return set(re.findall(r"\.entry\s+(\w+)\s*\(", nvrtc.getPTX(prog).decode()))


@pytest.mark.parametrize("name", sorted(kernels.PARTS))
def test_parts_hold_each_kernel_of_the_file_once(name):
    """A source compiled in parts (kernels.PARTS): every kernel of the whole file is in exactly one part, and the
    parts define nothing else, so a lookup across the parts finds each kernel, once."""
    whole = _entries(name, kernels.SOURCES[name])
    units = [_entries(name, d) for d in kernels.unit_defines(name)]
    assert len(units) == kernels.PARTS[name] and all(units), f"{name}: an empty part"
    union = set().union(*units)
    twice = sorted(k for k in union if sum(k in u for u in units) > 1)
    assert not twice, f"{name}: kernels in more than one part: {twice[:5]}"
    assert union == whole, f"{name}: parts miss {sorted(whole - union)[:5]}, add {sorted(union - whole)[:5]}"
