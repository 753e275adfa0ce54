#!/usr/bin/env python3
"""Checks that every #include in the tree follows the layering.

    core -> {backend, channel} -> alloc -> storage -> {ipc, lending} -> transfer -> python

A file belongs to a layer by its folder: include/shoal/<layer>/, src/<layer>/,
tests/<layer>/. It may include its own layer and the layers below it, nothing
else. tests/fuzz, the fuzz targets of the ipc and lending protocols and the kit
they share, is a layer of its own that may include those two and what they
rest on, and that no other layer may include. A public header
(include/) includes only public headers. Files in no layer (tests/support,
bench/, tools/) get the layers they include, transitively, so a test that
includes a helper takes on the helper's layers; programs in bench/ and tools/
may use any layer. A quoted include that names no layer is resolved beside the
including file (src/backend/cuda/cuda_device.h) or under tests/.

Usage: check_layers.py [ROOT]   (exit status 1 and one line per violation)
"""
import os
import re
import sys

# Each layer and the layers it may include (besides itself).
ALLOWED = {
    "core": set(),
    "backend": {"core"},
    "channel": {"core"},
    "alloc": {"core", "backend"},
    "storage": {"core", "backend", "alloc"},
    "ipc": {"core", "backend", "channel", "alloc", "storage"},
    "lending": {"core", "backend", "channel", "alloc", "storage"},
    "transfer": {"core", "backend", "channel", "alloc", "storage", "ipc", "lending"},
    "python": {"core", "backend", "channel", "alloc", "storage", "ipc", "lending", "transfer"},
    "fuzz": {"core", "backend", "channel", "alloc", "storage", "ipc", "lending"},
}
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
FREE_FOLDERS = ("bench", "tools")  # programs: any layer
TEST_FOLDERS_IN_NO_LAYER = ("support", "install_consumer", "shared_library")  # helpers take on what they include


def own_layer(rel):
    """The layer a file belongs to by its folder, or None."""
    parts = rel.split("/")
    if parts[:2] == ["include", "shoal"] and len(parts) > 3:
        return parts[2]
    if parts[0] in ("src", "tests") and len(parts) > 2:
        if parts[0] == "tests" and parts[1] in TEST_FOLDERS_IN_NO_LAYER:
            return None
        return parts[1]
    if parts[0] == "python":
        return "python"
    return None


def resolve(root, rel, name):
    """The tree-relative path a quoted include names, or None if outside the tree."""
    candidates = []
    if name.startswith("shoal/"):
        candidates.append("include/" + name)
    candidates += [os.path.join(os.path.dirname(rel), name), "src/" + name, "tests/" + name, name]
    for c in candidates:
        c = os.path.normpath(c)
        if os.path.isfile(os.path.join(root, c)):
            return c
    return None


def layer_of_target(target):
    parts = target.split("/")
    if parts[0] == "include":
        return parts[2] if len(parts) > 3 else None
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[0] == "tests" and len(parts) > 2 and parts[1] in ALLOWED:
        return parts[1]
    return None


def main(root):
    files = []
    for top in ("include", "src", "tests", "bench", "tools", "python"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for n in names:
                if n.endswith(SOURCE_SUFFIXES):
                    files.append(os.path.relpath(os.path.join(dirpath, n), root))
    includes = {}
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            includes[rel] = INCLUDE.findall(f.read())

    layers_used = {}  # layers a file in no layer reaches, transitively

    def reached(rel, seen):
        if rel in layers_used:
            return layers_used[rel]
        out = set()
        for name in includes.get(rel, []):
            target = resolve(root, rel, name)
            if target is None or target in seen:
                continue
            layer = layer_of_target(target)
            if layer is not None:
                out.add(layer)
            else:
                out |= reached(target, seen | {target})
        layers_used[rel] = out
        return out

    violations = []
    for rel in sorted(files):
        layer = own_layer(rel)
        if layer is not None and layer not in ALLOWED:
            violations.append(f"{rel}: folder names no layer ('{layer}'); the layers are {', '.join(ALLOWED)}")
            continue
        for name in includes[rel]:
            target = resolve(root, rel, name)
            if target is None:
                continue  # a system or generated header
            if rel.startswith("include/") and not target.startswith("include/"):
                violations.append(f'{rel}: a public header includes "{name}", which is not public')
                continue
            if layer is None or rel.split("/")[0] in FREE_FOLDERS:
                continue
            target_layer = layer_of_target(target)
            needed = {target_layer} if target_layer is not None else reached(target, {target})
            bad = sorted(l for l in needed if l != layer and l not in ALLOWED[layer])
            if bad:
                via = "" if target_layer is not None else f" (through {target})"
                violations.append(f'{rel}: layer {layer} includes "{name}" of layer {", ".join(bad)}{via}; '
                                  f"{layer} may include only {', '.join(sorted(ALLOWED[layer])) or 'nothing else'}")
    for v in violations:
        print(v)
    print(f"check_layers: {len(files)} files, {sum(len(v) for v in includes.values())} includes, "
          f"{len(violations)} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../.."))))
