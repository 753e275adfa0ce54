#!/usr/bin/env python3
"""Checks that a shared libshoal exports the public API and nothing else.

Every name of the shoal namespace that an exported symbol mentions — the
symbol's own scope and name, and any shoal type in its template arguments or
parameters — must be an identifier of a public header (include/shoal/, comments
left out). An exported symbol of no namespace the library owns or the C++
runtime instantiates (std, __gnu_cxx) is refused too: a static runtime
linked in (CUDA's) must not interpose on the program's own.

Usage: check_exports.py LIBRARY INCLUDE_DIR
       check_exports.py --symbols FILE INCLUDE_DIR   (demangled names, one a line)
Exit status 1 and one line per refused symbol.
"""
import pathlib
import re
import subprocess
import sys

IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
SHOAL_NAME = re.compile(r"\bshoal((?:::~?[A-Za-z_]\w*)+)")
# What a C++ program's own exports may hold besides shoal: the standard
# library's templates instantiated for shoal's use (named with their return
# type first, or as typeinfo, vtables, guards), and the ABI's helpers.
RUNTIME_NAME = re.compile(r"(?:^|[\s*&<(])(?:std|__gnu_cxx|__cxxabiv1)::|^operator (?:new|delete)")


def public_identifiers(include_dir):
    words = set()
    for header in pathlib.Path(include_dir).rglob("*.h"):
        words.update(IDENTIFIER.findall(COMMENT.sub(" ", header.read_text())))
    return words


def headers_without_default_visibility(include_dir):
    missing = []
    for header in sorted(pathlib.Path(include_dir).rglob("*.h")):
        text = header.read_text()
        push = text.find("#pragma GCC visibility push(default)")
        if push < 0 or not text.rstrip().endswith("#pragma GCC visibility pop"):
            missing.append(str(header))
    return missing


def exported_symbols(library):
    out = subprocess.run(["nm", "-D", "--defined-only", "-C", library],
                         check=True, capture_output=True, text=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] not in ("A",):  # A: the version nodes
            names.append(parts[2])
    return names


def refusals(symbols, public):
    refused = []
    for symbol in symbols:
        mentioned = SHOAL_NAME.findall(symbol)
        internal = sorted({part.lstrip("~") for scope in mentioned for part in scope.split("::")[1:]}
                          - public - {"operator"})
        if internal:
            refused.append(f"{symbol}  (internal: {', '.join(internal)})")
        elif not mentioned and not RUNTIME_NAME.search(symbol):
            refused.append(f"{symbol}  (not shoal's)")
    return refused


def main(argv):
    if len(argv) == 4 and argv[1] == "--symbols":
        symbols = pathlib.Path(argv[2]).read_text().splitlines()
        include_dir = argv[3]
    elif len(argv) == 3:
        symbols = exported_symbols(argv[1])
        include_dir = argv[2]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    public = public_identifiers(include_dir)
    unmarked = headers_without_default_visibility(include_dir)
    for header in unmarked:
        print("public header without visibility push(default) ... pop:", header)
    shoal_symbols = [s for s in symbols if SHOAL_NAME.search(s)]
    refused = refusals(symbols, public)
    for line in refused:
        print("exported but not public:", line)
    print(f"check_exports: {len(symbols)} exported, {len(shoal_symbols)} name shoal, {len(refused)} refused")
    if not shoal_symbols:
        print("check_exports: the library exports none of shoal's API")
        return 1
    return 1 if refused or unmarked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
