#!/usr/bin/env python3
"""Shows that check_layers.py catches what it exists to catch: copies the
tree's sources to a scratch folder, checks the copy passes, then plants one
violation at a time and checks that each is reported (exit status 1, the
planted file named). Prints one line per case."""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "check_layers.py")
ROOT = os.path.abspath(os.path.join(HERE, "../.."))

# (planted file, what it includes, why it is wrong)
CASES = [
    ("src/backend/planted.cpp", "shoal/alloc/caching_allocator.h", "a lower layer reaching up"),
    ("src/channel/planted.cpp", "shoal/backend/device.h", "the channel rests on core alone"),
    ("src/alloc/planted.cpp", "ipc/messages.h", "an internal header of a higher layer"),
    ("include/shoal/alloc/planted.h", "alloc/block.h", "a public header including an internal one"),
    ("tests/backend/planted_test.cpp", "shoal/ipc/sharing.h", "a backend test reaching the ipc layer"),
    ("tests/backend/planted_test.cpp", "support/allocators.h", "a backend test reaching alloc through a helper"),
    ("src/alocc/planted.cpp", "shoal/core/error.h", "a folder that names no layer"),
]


def check(root):
    return subprocess.run([sys.executable, CHECKER, root], capture_output=True, text=True)


def main():
    failures = 0
    with tempfile.TemporaryDirectory() as scratch:
        for top in ("include", "src", "tests"):
            shutil.copytree(os.path.join(ROOT, top), os.path.join(scratch, top))
        clean = check(scratch)
        if clean.returncode != 0:
            print("the unplanted copy fails:\n" + clean.stdout)
            return 1
        for rel, name, why in CASES:
            path = os.path.join(scratch, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(f'#include "{name}"\n')
            result = check(scratch)
            caught = result.returncode == 1 and rel in result.stdout
            print(f"{'caught' if caught else 'MISSED'}: {rel} including \"{name}\" ({why})")
            if not caught:
                print(result.stdout)
                failures += 1
            os.remove(path)
    print(f"planted violations: {len(CASES) - failures} of {len(CASES)} caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
