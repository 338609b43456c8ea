"""Pure-Python wheels for a GPU host without network access.

    python -m experiments.wheelhouse --dest .whl [--python-version 3.12]

The GPU benchmark host has torch, pandas, matplotlib, tqdm and joblib, but not Hydra. This
downloads the missing pure-Python wheels for the host's Python with ``pip download
--only-binary=:all:`` (the versions installed here, so the host runs what was tested), builds a
wheel locally with ``pip wheel`` where the index has only an sdist (antlr4-python3-runtime 4.9.3,
which Hydra 1.3 pins, is published as an sdist only), and prints how to install them offline.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["PACKAGES", "requirement", "build_wheelhouse", "install_instructions", "main"]

# What `python -m experiments.run` needs beyond the GPU host's image, and why.
PACKAGES = {
    "hydra-core": "the app and its sweeps",
    "omegaconf": "Hydra's config objects",
    "antlr4-python3-runtime": "Hydra's override parser (hydra-core 1.3 pins 4.9.3)",
    "hydra-joblib-launcher": "hydra/launcher=joblib for several GPUs of one host",
    "tabulate": "DataFrame.to_markdown (stream analysis tables)",
}


def requirement(name: str) -> str:
    """``name==<version installed here>``, or the bare name if it is not installed here."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def build_wheelhouse(dest: str | Path, python_version: str = "3.12",
                     packages: list[str] | None = None) -> list[Path]:
    """Put one pure-Python wheel per package into ``dest``; returns the wheel paths.

    Raises RuntimeError naming the package and pip's message if neither a download nor a local
    build works.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for req in [requirement(p) for p in (packages or list(PACKAGES))]:
        got = _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
                   "--implementation", "py", "--abi", "none", "--platform", "any", "-d", str(dest), req)
        if got.returncode != 0:  # sdist only: build a wheel here; pure Python, so it fits any host
            got = _pip("wheel", "--no-deps", "-w", str(dest), req)
        if got.returncode != 0:
            tail = "\n".join(got.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"could not download or build a wheel for {req}:\n{tail}")
        print(f"  {req}: ok")
    wheels = sorted(dest.glob("*.whl"))
    non_pure = [w.name for w in wheels if not w.name.endswith("-none-any.whl")]
    if non_pure:
        raise RuntimeError(f"not pure-Python wheels (they would not fit another Python): {non_pure}")
    return wheels


def install_instructions(dest: str | Path) -> str:
    """How to install the wheelhouse on the offline host (two ways)."""
    names = " ".join(PACKAGES)
    return "\n".join([
        f"Copy {dest}/ to the GPU host, then either install into its Python:",
        f"    python3 -m pip install --no-index --find-links {dest} {names}",
        "or, without touching the system site-packages:",
        f"    python3 -m pip install -q --no-index --no-deps --target /tmp/site {dest}/*.whl",
        "    export PYTHONPATH=/tmp/site:$PYTHONPATH",
        "Check: python3 -c 'import hydra, omegaconf; print(hydra.__version__)'",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=".whl", help="folder for the wheels (default .whl, git-ignored)")
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python (default 3.12)")
    args = parser.parse_args(argv)
    print(f"wheels for Python {args.python_version} into {args.dest}/:")
    try:
        wheels = build_wheelhouse(args.dest, args.python_version)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for w in wheels:
        print(f"  {w.name}")
    print(install_instructions(args.dest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
