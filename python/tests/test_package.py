"""The package ships type stubs for everything the extension module offers."""

import pathlib
import subprocess
import sys

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
