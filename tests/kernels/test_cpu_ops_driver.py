"""The CPU kernels (moe_serve/kernels/cpu_ops) through a C test driver (tests/kernels/cpu_ops_driver.c)
against its own double-precision references, for every ISA of vec.h: natively for each one this CPU
executes, built with the loader's target flags, and aarch64's NEON and plain-C paths built with a
cross compiler and run under user-mode emulation (Debian's qemu-user), so that a path no machine of
ours runs is still checked. Without those tools the aarch64 test fails, naming what to install
(scripts/setup.sh installs them when run as root)."""
from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moe_serve.kernels import cpu_ops

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "cpu_ops_driver.c"
SRCS = [str(p) for p in sorted((HERE.parents[1] / "moe_serve" / "kernels" / "cpu_ops").glob("*.c"))]
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")
AARCH64_APT = ("DEBIAN_FRONTEND=noninteractive apt-get install -y qemu-user gcc-aarch64-linux-gnu "
               "libc6-dev-arm64-cross")


def _build_and_run(cc: str, flags: list[str], exe: Path, runner: tuple[str, ...] = ()) -> str:
    # Each source compiled in a process of its own, as many at once as there are cores (largest
    # first), then one link: the plain-C build spends most of its time in quant.c alone.
    srcs = sorted([str(DRIVER), *SRCS], key=lambda p: -os.path.getsize(p))
    objs = [str(exe.parent / f"{i}_{Path(src).stem}.o") for i, src in enumerate(srcs)]

    def compile_one(i: int) -> subprocess.CompletedProcess:
        return subprocess.run([cc, "-O2", *flags, "-fopenmp", "-std=gnu11", "-c", "-o", objs[i], srcs[i]],
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for src, r in zip(srcs, pool.map(compile_one, range(len(srcs)))):
            assert r.returncode == 0, f"{cc} {' '.join(flags)} {src}: {r.stderr[-3000:]}"
    r = subprocess.run([cc, *flags, "-fopenmp", "-o", str(exe), *objs, "-lm"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{cc} {' '.join(flags)} (link): {r.stderr[-3000:]}"
    r = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout[-8000:] + r.stderr[-2000:]
    return r.stdout


@pytest.mark.skipif(cpu_ops._compiler() is None, reason="no C compiler: the engine runs torch ops only")
@pytest.mark.parametrize("isa", cpu_ops.runnable_isas())
def test_driver_on_this_cpu(isa, tmp_path):
    """Each ISA this CPU executes, built with the flags the loader uses for it."""
    out = _build_and_run(cpu_ops._compiler(), list(cpu_ops.target_flags(isa)), tmp_path / "driver")
    assert f"vec.h built for {isa}\n" in out and "checks passed" in out, out[-3000:]


@pytest.mark.parametrize("path", ["neon", "generic"])
def test_driver_on_aarch64(path, tmp_path):
    """aarch64's NEON path (-march=armv8.2-a) and its plain-C path, cross-built and run under
    qemu-aarch64 (natively on an aarch64 machine)."""
    flags = ["-march=armv8.2-a"] + (["-DCPU_OPS_GENERIC"] if path == "generic" else [])
    if cpu_ops._arch() == "aarch64":
        cc, runner = cpu_ops._compiler(), ()
        assert cc is not None, "no C compiler found ($CC, cc, gcc, clang)"
    else:
        cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
        missing = [name for name, ok in (("aarch64-linux-gnu-gcc", cc), ("qemu-aarch64", qemu),
                                         ("the aarch64 C library (/usr/aarch64-linux-gnu)",
                                          (AARCH64_SYSROOT / "include" / "stdio.h").exists()
                                          and (AARCH64_SYSROOT / "lib" / "libc.so.6").exists())) if not ok]
        if missing:
            pytest.fail(f"missing {', '.join(missing)}: the aarch64 kernels are tested under user-mode emulation. "
                        f"Install them with `{AARCH64_APT}` (Debian/Ubuntu; scripts/setup.sh does it when run as root)",
                        pytrace=False)
        runner = (qemu, "-L", str(AARCH64_SYSROOT))
    out = _build_and_run(cc, flags, tmp_path / "driver", runner)
    assert f"vec.h built for {path}\n" in out and "checks passed" in out, out[-3000:]
