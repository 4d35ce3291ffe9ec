"""Run the fast test tier under another torch, in a venv of its own (not .venv).

    python tools/torch_version_check.py 2.6.0 [--venv DIR] [--wheel FILE] [--extras hf,test,8bit,lightning,peft]

Creates DIR (default /tmp/memfit-torch-VERSION) when missing, installs torch==VERSION (or the
wheel given) and memfit's extras with torch pinned by a constraint (pip must never swap it),
then runs `make test-fast`'s pytest command on one worker. PyPI's Linux wheels are CUDA builds:
on a machine without a GPU they show what a CUDA user's import path does, and fake CUDA skips
(it is for the CPU build). Results of past runs: docs/limitations.md, "Older torch".
Not part of `make test`: the install is 3-5 GB and takes minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ["-m", "pytest", "-q", "--durations=20", "-n", "1", "--dist", "loadfile", "--no-loadscope-reorder", "-m", "not slow and not timing"]


def _install(venv: Path, version: str, wheel: str | None, extras: str) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
        pin.write(f"torch=={version}\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "-c", pin.name]
    subprocess.run([*pip, wheel or f"torch=={version}"], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[{extras}]"], check=True)
    if tuple(int(x) for x in version.split(".")[:2]) >= (2, 10):  # as the Makefile: torch_remat, never replacing torch
        subprocess.run([*pip, "--no-deps", "torch_remat>=0.2.2"], check=True)
    os.unlink(pin.name)
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="torch's version, such as 2.6.0")
    parser.add_argument("--venv", help="the venv's folder (default /tmp/memfit-torch-VERSION)")
    parser.add_argument("--wheel", help="a torch wheel file to install instead of torch==VERSION from the index")
    parser.add_argument("--extras", default="hf,test,8bit,lightning,peft", help="memfit's extras to install (default %(default)s)")
    args, rest = parser.parse_known_args(argv)
    python = _install(Path(args.venv or f"/tmp/memfit-torch-{args.version}"), args.version, args.wheel, args.extras)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([str(python), *FAST, *rest], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
