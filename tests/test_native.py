"""The optional compiled build's guards (tidegate.native); the build itself is checked by
`make native-check`, which compiles a copy of src and runs the core's and simulator's tests."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidegate import native

EXTENSION = importlib.machinery.EXTENSION_SUFFIXES[0]


def _package(root: Path) -> Path:
    package = root / "tidegate"
    for folder in ("core", "sim"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "core" / "queue.py").write_text("")
    (package / "clock.py").write_text("")
    return package


def test_the_build_covers_every_core_module_and_the_simulators_hot_path() -> None:
    sources = native.compiled_sources()
    names = {str(source.relative_to(native.PACKAGE_DIR)) for source in sources}
    core = {f"core/{path.name}" for path in (native.PACKAGE_DIR / "core").glob("*.py")}
    assert core <= names
    assert {"sim/run.py", "sim/workers.py", "sim/gateway.py", "sim/kernel.py"} <= names
    assert all(source.exists() for source in sources)


def test_a_source_edited_after_its_build_is_stale_and_a_fresh_build_is_not(
    tmp_path: Path,
) -> None:
    package = _package(tmp_path)
    source = package / "core" / "queue.py"
    built = source.with_suffix(EXTENSION)
    built.write_text("")
    os.utime(source, (1_000, 1_000))
    os.utime(built, (2_000, 2_000))
    assert native.stale_sources(package) == []
    os.utime(source, (3_000, 3_000))
    assert native.stale_sources(package) == [source]
    assert native.stale_sources(_package(tmp_path / "none")) == []  # no build: nothing stale


@pytest.fixture
def fake_package(tmp_path: Path) -> Iterator[str]:
    """A package whose module has a broken extension beside its source."""
    package = tmp_path / "tgnative_fake"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("WHERE = 'source'\n")
    (package / f"mod{EXTENSION}").write_text("not an extension")  # Python tries it first
    (package / "sub" / "__init__.py").write_text("")  # a compiled package's __init__
    (package / "sub" / f"__init__{EXTENSION}").write_text("not an extension")
    (package / "sub" / "leaf.py").write_text("WHERE = 'leaf source'\n")
    sys.path.insert(0, str(tmp_path))
    yield "tgnative_fake"
    sys.path.remove(str(tmp_path))
    for name in [name for name in sys.modules if name.startswith("tgnative_fake")]:
        del sys.modules[name]


def test_without_the_finder_python_imports_the_extension_first(fake_package: str) -> None:
    with pytest.raises(ImportError):
        importlib.import_module(f"{fake_package}.mod")
    with pytest.raises(ImportError):
        importlib.import_module(f"{fake_package}.sub.leaf")


def test_source_first_imports_the_py_beside_a_compiled_module(fake_package: str) -> None:
    finder = native.SourceFirst(fake_package)
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module(f"{fake_package}.mod")
        leaf = importlib.import_module(f"{fake_package}.sub.leaf")
    finally:
        sys.meta_path.remove(finder)
    assert module.WHERE == "source"
    assert module.__file__ is not None
    assert module.__file__.endswith("mod.py")
    assert leaf.WHERE == "leaf source"


def test_a_stale_build_refuses_to_import_and_names_the_file_and_the_fix(tmp_path: Path) -> None:
    package = _package(tmp_path)
    source = package / "core" / "queue.py"
    built = source.with_suffix(EXTENSION)
    built.write_text("")
    os.utime(built, (1_000, 1_000))
    with pytest.raises(ImportError, match=r"tidegate/core/queue.py changed .* `make compiled`"):
        native.activate(package, environ={})
    before = list(sys.meta_path)
    native.activate(package, environ={native.PURE_ENV: "1"})  # pure: no check, source first
    try:
        assert any(isinstance(finder, native.SourceFirst) for finder in sys.meta_path)
    finally:
        sys.meta_path[:] = before


def test_without_a_c_compiler_it_says_no_build_can_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no compiler on it
    reason = native.missing_toolchain()
    assert reason is not None
    assert "no C compiler" in reason
    assert native.main(["can-build"]) == 1
