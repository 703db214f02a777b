"""Every script under benchmarks/ compiles: most of them run only on a GPU, where a syntax
error (such as a name used before its `global` statement, which the linter does not report)
costs a device call to find."""

import pathlib
import py_compile

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_scripts_are_found():
    assert len(SCRIPTS) > 10
