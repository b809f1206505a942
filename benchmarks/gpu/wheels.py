"""Download, here, the wheels a GPU machine without network lacks, into ``.whl/`` (git-ignored),
which ``benchmarks/gpu/run.sh`` installs there with ``pip install --no-index --no-deps``.

    python benchmarks/gpu/wheels.py              # the exact list, pinned to this environment's versions
    python benchmarks/gpu/wheels.py --print      # the pip command only

The GPU machine has python 3.12 with torch (CUDA), lightning, transformers, peft, accelerate,
safetensors, tokenizers, pyarrow, pandas, matplotlib, psutil, rich and pytest; it lacks the
packages in :data:`CARRIED`. They are downloaded without their dependencies (``--no-deps``): the
list is the whole of what is missing, and each is pinned to the version this environment runs
its tests with. DeepSpeed has no wheel on PyPI (it builds from source), so its configs are
skipped there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What the GPU machine lacks: bitsandbytes (the 8-bit optimizers, 4-bit bases), jsonargparse and
#: what its ``signatures`` extra needs (LightningCLI), datasets and its own dependencies that are
#: not there either; and liger-kernel (pure Python over Triton, which torch's CUDA wheels bring), for
#: the ``LigerKernels`` rows of the GPU step-time benchmark.
CARRIED = ("bitsandbytes", "jsonargparse", "typeshed-client", "docstring-parser",
           "datasets", "dill", "multiprocess", "xxhash", "liger-kernel")
PYTHON_VERSION = "3.12"
# bitsandbytes and xxhash ship manylinux wheels of different glibc baselines; list the ones a
# current Linux with CUDA accepts (pip does not widen a --platform it is given).
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64")
#: What may travel with the working tree to the device machine in all; bitsandbytes is most of it.
CARRY_LIMIT_BYTES = 64 << 20


def requirements() -> list[str]:
    """``name==version`` for each carried package, at this environment's version (unpinned if absent)."""
    pinned = []
    for name in CARRIED:
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(name)
    return pinned


def pip_command(dest: Path, python: str = sys.executable) -> list[str]:
    """The ``pip download`` that fetches the carried wheels for CPython 3.12 on x86-64 Linux."""
    cmd = [python, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--dest", str(dest),
           "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", f"cp{PYTHON_VERSION.replace('.', '')}"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + requirements()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/wheels.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="where the wheels go (default: .whl/)")
    parser.add_argument("--print", action="store_true", help="print the pip command, download nothing")
    args = parser.parse_args(argv)
    cmd = pip_command(args.dest)
    print(" ".join(cmd))
    if args.print:
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, check=False)
    if done.returncode:
        return done.returncode
    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:8.2f} MiB in {len(wheels)} wheels (the working tree may carry {CARRY_LIMIT_BYTES >> 20} MiB in all)")
    if total > CARRY_LIMIT_BYTES:
        print(f"too large to carry: remove stale wheels from {args.dest}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
