#!/usr/bin/env python3
"""Regenerates python/shoal/_shoal.pyi from the installed extension module.

nanobind's stubgen writes the classes and functions, the package's private
helpers (underscored) included so that its modules type-check against the
stub (python/tests/test_package.py); the exception classes,
which the module creates at run time, are the hand-written part at the top of
the stub (everything before the line `class Device:`), kept as it is.

Usage: generate_stubs.py [--check]   (--check: exit 1 when the stub is stale)
"""
import pathlib
import subprocess
import sys
import tempfile

STUB = pathlib.Path(__file__).parent / "shoal" / "_shoal.pyi"
FIRST_GENERATED = "\nclass Device:"


def generated_body() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "_shoal.pyi"
        subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-P", "-m", "shoal._shoal", "-o", str(out)], check=True)
        text = out.read_text()
    return text[text.index(FIRST_GENERATED):]


def main(check: bool) -> int:
    current = STUB.read_text()
    wanted = current[: current.index(FIRST_GENERATED)] + generated_body()
    if current == wanted:
        return 0
    if check:
        print(f"{STUB} is stale: run python/generate_stubs.py with the package installed", file=sys.stderr)
        return 1
    STUB.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
