"""A plugin may import only the public API of kvxfer: ``kvxfer``, ``kvxfer.transport`` (for
transports) and ``kvxfer.store`` (for store backends).

:func:`private_imports` lists the imports of a plugin's source that reach further (e.g.
``kvxfer.server.arena``), so a plugin's tests can assert there are none::

    assert private_imports(Path(kvxfer_my_transport.__file__).parent) == []
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Final

__all__ = ["PUBLIC_MODULES", "private_imports"]

#: The modules of kvxfer a plugin may import from.
PUBLIC_MODULES: Final = frozenset({"kvxfer", "kvxfer.transport", "kvxfer.store"})


def private_imports(package_dir: Path) -> list[str]:
    """``"file:line: module"`` for every import under ``package_dir`` (every ``*.py``,
    recursively) of a kvxfer module other than the public ones, or of a name they do not
    export in ``__all__``."""
    found = []
    for path in sorted(Path(package_dir).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module in PUBLIC_MODULES:  # `from kvxfer import layout` is a way round
                    exported = _exports(node.module)
                    names += [f"{node.module}.{a.name}" for a in node.names
                              if a.name != "*" and a.name not in exported]
            else:
                continue
            for name in names:
                if (name == "kvxfer" or name.startswith("kvxfer.")) and name not in PUBLIC_MODULES:
                    found.append(f"{path}:{node.lineno}: {name}")
    return found


def _exports(module: str) -> frozenset[str]:
    return frozenset(getattr(importlib.import_module(module), "__all__", ()))
