#!/usr/bin/env python3
"""Checks that a shared libshoal exports the public API and nothing else.

Every name of the shoal namespace that an exported symbol mentions — the
symbol's own scope and name, and any shoal type in its template arguments or
parameters — must be an identifier of a public header (include/shoal/, comments
left out), and none may be a scope inside a class that a public header names
only as hidden (`class __attribute__((visibility("hidden"))) state;`: the
library's own, whatever its name). A symbol that names no shoal identifier
must be the standard library's or the ABI's own (its qualified name in std,
__gnu_cxx or __cxxabiv1, or operator new/delete): a static library linked in
(CUDA's runtime) must not interpose on the program's own.

And every public header declares its API inside one "#pragma GCC visibility
push(default)" line before its first namespace and one "pop" as its last line
(the library compiles with hidden visibility: a header without them would
leave its functions out of the exports).

Usage: check_exports.py LIBRARY INCLUDE_DIR
       check_exports.py --symbols FILE INCLUDE_DIR   (demangled names, one a line)
Exit status 1 and one line per refusal.
"""
import pathlib
import re
import subprocess
import sys

IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
SHOAL_NAME = re.compile(r"\bshoal((?:::~?[A-Za-z_]\w*)+)")
HIDDEN_DECLARATION = re.compile(r"\b(?:class|struct)\s+__attribute__\(\(visibility\(\"hidden\"\)\)\)\s+(\w+)")
PUSH = "#pragma GCC visibility push(default)"
POP = "#pragma GCC visibility pop"
# The ABI's names for what belongs to a class (its typeinfo, vtable, ...).
SPECIAL_PREFIX = re.compile(r"^(?:(?:typeinfo name|typeinfo|vtable|VTT|construction vtable|guard variable|"
                            r"TLS init function|TLS wrapper function|thread-local wrapper routine|"
                            r"(?:non-)?virtual thunk to|covariant return thunk to) for |"
                            r"(?:non-)?virtual thunk to )+")
OPERATOR = re.compile(r"operator(?:<<=|>>=|<<|>>|<=>|<=|>=|->\*|->|<|>|\(\)|\[\])")
RUNTIME_SCOPES = ("std::", "__gnu_cxx::", "__cxxabiv1::")


def header_texts(include_dir):
    return {header: COMMENT.sub(" ", header.read_text()) for header in sorted(pathlib.Path(include_dir).rglob("*.h"))}


def public_identifiers(texts):
    words = set()
    for text in texts.values():
        words.update(IDENTIFIER.findall(text))
    return words


def hidden_classes(texts):
    return {name for text in texts.values() for name in HIDDEN_DECLARATION.findall(text)}


def headers_without_default_visibility(include_dir):
    missing = []
    for header in sorted(pathlib.Path(include_dir).rglob("*.h")):
        lines = [line.strip() for line in header.read_text().splitlines()]
        code = [line for line in lines if line]
        pushes = [i for i, line in enumerate(lines) if line == PUSH]
        pops = [i for i, line in enumerate(lines) if line == POP]
        namespaces = [i for i, line in enumerate(lines) if line.startswith("namespace ")]
        if (len(pushes) != 1 or len(pops) != 1 or not code or code[-1] != POP or not namespaces
                or pushes[0] > namespaces[0]):
            missing.append(str(header))
    return missing


def exported_symbols(library):
    out = subprocess.run(["nm", "-D", "--defined-only", "-C", library],
                         check=True, capture_output=True, text=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] != "A":  # A: the version nodes
            names.append(parts[2])
    return names


def own_name(symbol):
    """The symbol's qualified name without template arguments, parameters and
    return type: "void std::vector<int>::f<x>(y) const" -> "std::vector::f"."""
    text = OPERATOR.sub("operator", SPECIAL_PREFIX.sub("", symbol))
    depth = 0
    top = []
    for ch in text:
        if ch in "<({[":
            depth += 1
        elif ch in ">)}]":
            depth = max(0, depth - 1)
        elif depth == 0:
            top.append(ch)
    words = "".join(top).split()
    while words and words[-1] in ("const", "volatile", "&", "&&", "noexcept"):
        words.pop()
    return words[-1] if words else ""


def refusals(symbols, public, hidden):
    refused = []
    for symbol in symbols:
        mentioned = [scope.split("::")[1:] for scope in SHOAL_NAME.findall(symbol)]
        internal = {part.lstrip("~") for parts in mentioned for part in parts} - public - {"operator"}
        # A hidden class used as a scope: its members, or its typeinfo and vtable.
        special = SPECIAL_PREFIX.match(symbol) is not None
        internal |= {parts[i] for parts in mentioned for i in range(len(parts))
                     if parts[i] in hidden and (i + 1 < len(parts) or special)}
        if internal:
            refused.append(f"{symbol}  (internal: {', '.join(sorted(internal))})")
        elif not mentioned and not (own_name(symbol).startswith(RUNTIME_SCOPES) or
                                    re.match(r"^operator (?:new|delete)", symbol)):
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
    texts = header_texts(include_dir)
    refused = refusals(symbols, public_identifiers(texts), hidden_classes(texts))
    for line in refused:
        print("exported but not public:", line)
    unmarked = headers_without_default_visibility(include_dir)
    for header in unmarked:
        print("public header without one visibility push(default) before its namespace and a pop last:", header)
    shoal_symbols = [s for s in symbols if SHOAL_NAME.search(s)]
    print(f"check_exports: {len(symbols)} exported, {len(shoal_symbols)} name shoal, {len(refused)} refused, "
          f"{len(unmarked)} headers unmarked")
    if not shoal_symbols:
        print("check_exports: the library exports none of shoal's API")
        return 1
    return 1 if refused or unmarked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
