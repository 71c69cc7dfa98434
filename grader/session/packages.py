"""Finding and loading an implementation package (`--impl`) or a reference package (`--reference`).

Either is given as a directory or as the name of an importable package. A name is looked up on sys.path by hand,
without importing anything, because the grader's own process must never execute student code.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


@dataclass(frozen=True)
class PackageSpec:
    name: str  # the top-level name the package is imported under
    path: Path  # its directory

    def module_file(self, problem_id: str) -> Path:
        return self.path.joinpath(*problem_id.split(".")).with_suffix(".py")

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path)}

    @classmethod
    def from_json(cls, data: dict) -> "PackageSpec":
        return cls(data["name"], Path(data["path"]))


def resolve(value: str, search_path: list[str] | None = None) -> PackageSpec:
    """A directory, or a package name found on `search_path` (sys.path by default)."""
    as_dir = Path(value).expanduser()
    if as_dir.is_dir():
        as_dir = as_dir.resolve()
        return PackageSpec(as_dir.name, as_dir)
    parts = value.split(".")
    if all(part.isidentifier() for part in parts):
        for entry in search_path if search_path is not None else sys.path:
            candidate = Path(entry or ".").joinpath(*parts)
            if candidate.is_dir():
                return PackageSpec(parts[-1], candidate.resolve())
    raise ValueError(f"{value!r} is neither a directory nor an importable package")


def load_problem_module(spec: PackageSpec, problem_id: str) -> ModuleType:
    """Import `<package>.<problem_id>` from the package's directory, whatever is on sys.path."""
    package = sys.modules.get(spec.name)
    if package is None or Path(getattr(package, "__path__", [""])[0]).resolve() != spec.path:
        init = spec.path / "__init__.py"
        if init.exists():
            module_spec = importlib.util.spec_from_file_location(
                spec.name, init, submodule_search_locations=[str(spec.path)]
            )
        else:
            module_spec = importlib.machinery.ModuleSpec(spec.name, None, is_package=True)
            module_spec.submodule_search_locations = [str(spec.path)]
        package = importlib.util.module_from_spec(module_spec)
        sys.modules[spec.name] = package
        if init.exists():
            module_spec.loader.exec_module(package)
    return importlib.import_module(f"{spec.name}.{problem_id}")
