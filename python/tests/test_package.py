"""The package ships type stubs for everything the extension module offers, and its documented examples are
Python."""

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import shoal
from shoal import _shoal


def test_type_stubs_are_shipped_and_cover_every_public_name():
    package = pathlib.Path(shoal.__file__).parent
    assert (package / "py.typed").exists()
    stub = (package / "_shoal.pyi").read_text()
    for name in dir(_shoal):
        if not name.startswith("_"):
            assert f"def {name}(" in stub or f"class {name}(" in stub or f"class {name}:" in stub, name


def test_every_public_name_has_a_docstring():
    for name in shoal.__all__:
        assert getattr(shoal, name).__doc__, name


def test_the_stub_matches_the_module():
    pytest.importorskip("nanobind.stubgen")
    script = pathlib.Path(__file__).parents[1] / "generate_stubs.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_array_protocol_is_typed_as_numpy_calls_it():
    # numpy passes copy as a bool or None; numpy is no dependency of the package, so the return is object.
    stub = (pathlib.Path(shoal.__file__).parent / "_shoal.pyi").read_text()
    signature = "def __array__(self, dtype: object | None = None, copy: bool | None = None) -> object:"
    assert stub.count(signature) == 2, "Storage.__array__ and ArrayView.__array__"


# What a user's type checker sees: the stub must check, and the README's usage must check
# against it (context managers give their own type, the counters are a dict).
USAGE = """
import numpy
import shoal
import shoal.sharing

allocator = shoal.default_allocator()
allocated: int = allocator.stats()["allocated_bytes"]["all"]["current"]
segments: list[dict[str, int]] = allocator.snapshot()["segments"]
kinds = [event["action"] for event in allocator.trace()]
storage = allocator.allocate(64)
is_host: bool = storage.device == shoal.default_device()
if is_host:
    array = numpy.from_dlpack(storage.view("float32", (16,)))  # the array API's protocol, as numpy types it
    data = numpy.asarray(storage, copy=False)  # __array__, as numpy calls it
def first_images(consumer: shoal.sharing.Consumer) -> object:
    return consumer.get()["images"]  # a batch is what the producer put: a dict here
def send_bytes(producer: shoal.sharing.Producer) -> None:
    producer.put(storage)  # a Storage is a batch too (sent as bytes)
def trusting(address: str, uids: list[int]) -> shoal.sharing.Consumer:
    return shoal.sharing.Consumer(address, allowed_uids=uids)  # any sequence of uids, as Listener takes
with shoal.Listener("@shoal-typing-example") as listener:
    connection = listener.accept(timeout=0.1)
    if connection is not None:
        with shoal.Peer(shoal.SharingContext(allocator), connection) as peer:
            peer.close()
"""


def test_the_package_type_checks_against_its_stub(tmp_path):
    # The modules call the extension's private helpers too: the stub types
    # them (generate_stubs.py keeps underscored names), so a changed binding
    # that a module calls the old way fails here, not in a user's program.
    mypy = pytest.importorskip("mypy.api")
    package = pathlib.Path(__file__).parents[1] / "shoal"
    report, errors, status = mypy.run([
        "--no-incremental", "--cache-dir", str(tmp_path / "cache"), "--ignore-missing-imports", str(package)])
    assert status == 0, report + errors


def test_the_stub_and_its_usage_type_check(tmp_path):
    mypy = pytest.importorskip("mypy.api")
    usage = tmp_path / "usage.py"
    usage.write_text(textwrap.dedent(USAGE))
    package = pathlib.Path(__file__).parents[1] / "shoal"
    report, errors, status = mypy.run([
        "--no-incremental", "--cache-dir", str(tmp_path / "cache"), "--ignore-missing-imports",
        str(package / "_shoal.pyi"), str(package / "__init__.py"), str(usage)])
    assert status == 0, report + errors


REPOSITORY = pathlib.Path(__file__).parents[2]


def readme_examples():
    """The README's ```python blocks, as (where, code)."""
    text = (REPOSITORY / "README.md").read_text()
    for block in re.finditer(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE):
        yield f"README.md:{text.count(chr(10), 0, block.start()) + 2}", block.group(1)


def docstring_examples():
    """The examples in the package's docstrings, as (where, code): every block indented under its
    text after a blank line (reST literal blocks after "::", and plain indented ones). A block of
    "$ " lines is a shell session, not Python."""
    for path in sorted((REPOSITORY / "python" / "shoal").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = (ast.get_docstring(node) or "").splitlines()
            i = 0
            while i < len(lines):
                if not (lines[i].startswith(" ") and i > 0 and not lines[i - 1].strip()):
                    i += 1
                    continue
                start = i
                while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                    i += 1
                code = textwrap.dedent("\n".join(lines[start:i]))
                if not code.startswith("$ "):
                    yield f"{path.name}, {getattr(node, 'name', 'module')} docstring, line {start + 1}", code


def test_every_documented_example_is_python():
    # Syntax only: a sketch may name the reader's own objects (it says so in a first comment line).
    readme = list(readme_examples())
    assert len(readme) == (REPOSITORY / "README.md").read_text().count("```python")
    docstrings = list(docstring_examples())
    assert len(docstrings) >= 10, "the docstrings' examples were not found"
    broken = []
    for where, code in readme + docstrings:
        try:
            compile(code, where, "exec")
        except SyntaxError as error:
            broken.append(f"{where}: {error.msg} (line {error.lineno} of the block)")
    assert not broken, "\n".join(broken)


def test_the_version_is_the_installed_distributions():
    import importlib.metadata

    assert shoal.__version__ == importlib.metadata.version("shoal")
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", shoal.__version__), shoal.__version__
