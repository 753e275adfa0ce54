#!/usr/bin/env python3
"""Shows that check_exports.py refuses what it exists to refuse: a list of
exported symbols that passes, then one planted export at a time (and public
headers with their visibility pragmas missing or misplaced), each of which must be refused
(exit status 1, the planted line named). Prints one line per case."""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "check_exports.py")
INCLUDE = os.path.abspath(os.path.join(HERE, "../../include"))

PUBLIC = [
    "shoal::alloc::caching_allocator::allocate(unsigned long, shoal::backend::stream_ref)",
    "typeinfo for shoal::out_of_memory",
    "vtable for shoal::backend::device",
    "std::vector<shoal::alloc::segment_snapshot, std::allocator<shoal::alloc::segment_snapshot> >::~vector()",
    "void std::_Destroy_aux<false>::__destroy<std::__cxx11::basic_string<char> *>(std::__cxx11::basic_string<char> *)",
    "operator new(unsigned long)",
]
# (planted export, why it is wrong)
CASES = [
    ("shoal::alloc::detail::segment_source::grow(shoal::alloc::detail::block_pool&, unsigned long, bool)",
     "an internal class's function"),
    ("typeinfo for shoal::ipc::detail::consumer_state", "an internal class's typeinfo"),
    ("std::vector<shoal::alloc::detail::block*, std::allocator<shoal::alloc::detail::block*> >::_M_realloc_insert()",
     "a standard template instantiated for an internal type"),
    ("shoal::alloc::caching_allocator::allocate(unsigned long, shoal::alloc::detail::block_pool&)",
     "a public function with an internal parameter type"),
    ("cudaMalloc", "a static runtime's C function, which would interpose on the program's"),
    ("shoal::alloc::detail::allocator_core::allocate(unsigned long, shoal::backend::stream_ref)",
     "a member of a class the public headers name only as hidden (its words public)"),
    ("vtable for shoal::ipc::sharing_context::collector", "the vtable of a hidden nested class"),
    ("fmt::v9::vformat(std::basic_string_view<char, std::char_traits<char> >, fmt::v9::format_args)",
     "a static C++ library's function that takes standard types"),
]
# (what is done to core/error.h's pragmas, why it is wrong)
HEADER_CASES = [
    (lambda text: text.replace("#pragma GCC visibility push(default)\n", ""), "no push"),
    (lambda text: text.replace("#pragma GCC visibility push(default)", "// #pragma GCC visibility push(default)"),
     "a push commented out"),
    (lambda text: text.replace("#pragma GCC visibility push(default)",
                               "#pragma GCC visibility push(default)\n#pragma GCC visibility pop"),
     "a pop right after the push, the declarations left hidden"),
    (lambda text: text.rstrip().removesuffix("#pragma GCC visibility pop") + "\n", "no pop at the end"),
]


def check(symbols, include):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listing:
        listing.write("\n".join(symbols) + "\n")
    try:
        return subprocess.run([sys.executable, CHECKER, "--symbols", listing.name, include],
                              capture_output=True, text=True)
    finally:
        os.unlink(listing.name)


def main():
    failures = 0
    clean = check(PUBLIC, INCLUDE)
    if clean.returncode != 0:
        print("the public list is refused:\n" + clean.stdout)
        return 1
    print("passes: the public list")
    for planted, why in CASES:
        result = check(PUBLIC + [planted], INCLUDE)
        caught = result.returncode == 1 and planted in result.stdout
        print(("refused: " if caught else "MISSED: ") + why)
        failures += not caught
    if check([], INCLUDE).returncode != 1:
        print("MISSED: a library that exports none of the API")
        failures += 1
    else:
        print("refused: a library that exports none of the API")
    for change, why in HEADER_CASES:
        with tempfile.TemporaryDirectory() as scratch:
            include = os.path.join(scratch, "include")
            shutil.copytree(INCLUDE, include)
            header = os.path.join(include, "shoal", "core", "error.h")
            with open(header) as f:
                text = f.read()
            with open(header, "w") as f:
                f.write(change(text))
            result = check(PUBLIC, include)
            caught = result.returncode == 1 and "error.h" in result.stdout
            print(("refused: " if caught else "MISSED: ") + "a public header with " + why)
            failures += not caught
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
