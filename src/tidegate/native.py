"""An optional compiled build of the core and the simulator's hot path (mypyc).

The simulator runs every request through the same ``core`` objects as the server, so its
speed is the core's speed in the interpreter. mypyc compiles these modules, type-annotated
Python checked by mypy, to C extensions from the same source: ``make compiled`` (about a
minute on 2 cores) writes them beside the ``.py`` files, where Python imports them first;
``make pure`` removes them. Nothing else changes: same classes, same tests. A compiled build
checks at run time the annotations the interpreter ignores (an ``int`` attribute given a
float raises ``TypeError``), and its classes take no monkeypatched methods.

Two guards, run when ``tidegate`` is imported (:func:`activate`):

- a ``.py`` edited after its build would be shadowed by the stale extension: refused with
  the fix (``ImportError``), never run silently;
- ``TIDEGATE_PURE_PYTHON=1`` imports every module from its ``.py`` even where a build sits
  beside it (``make test`` sets it: the suite's spies need the interpreted classes; the
  compiled build has its own check, ``make native-check``).

:func:`main` (``build``, ``clean``, ``status``), run from the ``src`` folder of an editable
install, is what the Makefile calls.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent
PURE_ENV = "TIDEGATE_PURE_PYTHON"

# What mypyc compiles: every core module (mypy-strict already) and the simulator's event
# loop, gateway, workers, fleet and recorder, the code a simulated request runs through.
# Other modules they import stay interpreted and are seen as untyped (``follow_imports =
# skip``), which keeps the build to about a minute.
SIM_MODULES = ("kernel", "gateway", "workers", "recorder", "fleet", "run")


def compiled_sources(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The ``.py`` files a build compiles."""
    core = sorted((package_dir / "core").glob("*.py"))
    sim = [package_dir / "sim" / f"{name}.py" for name in SIM_MODULES]
    return [*core, *sim, package_dir / "clock.py"]


def _extension_of(source: Path) -> Path | None:
    """The compiled module beside ``source``, if one is there."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = source.with_suffix(suffix)
        if candidate.exists():
            return candidate
    return None


def compiled_modules() -> list[str]:
    """The modules that import from a compiled build here, as dotted names."""
    root = PACKAGE_DIR.parent
    found = []
    for source in compiled_sources():
        if _extension_of(source) is not None:
            found.append(".".join(source.relative_to(root).with_suffix("").parts))
    return found


def stale_sources(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Sources edited after their compiled build (the build would run old code)."""
    stale = []
    for source in compiled_sources(package_dir):
        extension = _extension_of(source)
        if extension is not None and source.stat().st_mtime > extension.stat().st_mtime:
            stale.append(source)
    return stale


class SourceFirst(importlib.abc.MetaPathFinder):
    """Finds a package's modules from their ``.py`` where a compiled build sits beside it."""

    def __init__(self, package: str = "tidegate") -> None:
        self.prefix = f"{package}."

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.prefix):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            return spec
        built = Path(origin)
        if built.name.startswith("__init__."):  # a compiled package: its __init__.py
            init = built.with_name("__init__.py")
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[str(init.parent)]
            )
        leaf = fullname.rpartition(".")[2]
        return importlib.util.spec_from_file_location(fullname, built.with_name(f"{leaf}.py"))


def activate(package_dir: Path = PACKAGE_DIR, environ: Mapping[str, str] = os.environ) -> None:
    """Apply the two guards of the module docstring; called by ``tidegate/__init__``."""
    if environ.get(PURE_ENV, "") not in ("", "0"):
        if not any(isinstance(finder, SourceFirst) for finder in sys.meta_path):
            sys.meta_path.insert(0, SourceFirst())
        return
    stale = stale_sources(package_dir)
    if stale:
        names = ", ".join(str(source.relative_to(package_dir.parent)) for source in stale[:3])
        raise ImportError(
            f"tidegate: {names}{' ...' if len(stale) > 3 else ''} changed after the compiled "
            "build beside it, which would run the old code: run `make compiled` again, "
            f"`make pure` to remove the build, or set {PURE_ENV}=1"
        )


def _remove_build() -> int:
    removed = 0
    for source in compiled_sources():
        while (extension := _extension_of(source)) is not None:
            extension.unlink()
            removed += 1
    for shared in PACKAGE_DIR.parent.glob("*__mypyc" + "*"):  # mypyc's runtime, beside tidegate/
        shared.unlink()
        removed += 1
    return removed


def _build(build_dir: Path) -> None:
    """Compile :func:`compiled_sources` in place (run from the folder holding ``tidegate``)."""
    from mypyc.build import mypycify  # the dev extra's mypy; imported only to build
    from setuptools import setup

    if Path.cwd().resolve() != PACKAGE_DIR.parent:
        raise SystemExit(f"run this from {PACKAGE_DIR.parent}: the build is written in place")
    _remove_build()
    build_dir.mkdir(parents=True, exist_ok=True)
    config = build_dir / "mypyc.ini"
    config.write_text(
        "[mypy]\npython_version = 3.11\nignore_missing_imports = True\n"
        f"follow_imports = skip\ncache_dir = {build_dir / 'mypy-cache'}\n"
    )
    root = PACKAGE_DIR.parent
    paths = [str(source.relative_to(root)) for source in compiled_sources()]
    modules = mypycify(
        ["--config-file", str(config), *paths],
        opt_level="3",
        multi_file=True,
        target_dir=str(build_dir / "c"),
    )
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    setup(
        name="tidegate-native",
        ext_modules=modules,
        script_args=[
            "--quiet",
            "build_ext",
            "--inplace",
            "-j",
            jobs,
            "-b",
            str(build_dir / "lib"),
            "-t",
            str(build_dir / "tmp"),
        ],
    )
    # setuptools relinks nothing whose C is unchanged (mypyc rewrites a C file only when
    # it changes) and copies the old extension in with its old time: mark the build as of
    # now, or a source merely touched since would read as stale forever
    for source in compiled_sources():
        extension = _extension_of(source)
        if extension is not None:
            os.utime(extension)
    for shared in root.glob("*__mypyc" + "*"):
        os.utime(shared)


def missing_toolchain() -> str | None:
    """Why no build can be made here (no C compiler, no Python headers), or None."""
    import shutil
    import sysconfig

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler}) on PATH"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        return f"no Python headers ({headers})"
    return None


def main(argv: Sequence[str]) -> int:
    command = argv[0] if argv else "status"
    if command == "build":
        build_dir = Path(argv[1]) if len(argv) > 1 else PACKAGE_DIR.parents[1] / "build" / "native"
        _build(build_dir.resolve())
        print(f"compiled {len(compiled_modules())} modules with mypyc")
    elif command == "clean":
        print(f"removed {_remove_build()} compiled files")
    elif command == "can-build":
        reason = missing_toolchain()
        if reason is not None:
            print(f"no compiled build can be made here: {reason}")
            return 1
    elif command == "status":
        found = compiled_modules()
        stale = stale_sources()
        print(f"compiled: {len(found)} of {len(compiled_sources())} modules; stale: {len(stale)}")
    else:
        print("usage: python -m tidegate.native build [BUILD_DIR] | clean | status | can-build")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
