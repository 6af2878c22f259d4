"""The layering of docs/architecture.md, enforced: every import inside `lorafleet/` (module
level, function-local and under `if TYPE_CHECKING:`, which count like any other) must go to a
layer its importer may use. The seams are the one exception for type-only imports: any layer
(but the pure leaves) may import `interfaces` under TYPE_CHECKING to name a protocol, and
`interfaces` itself imports nothing at run time and names, under TYPE_CHECKING, the types of
the layers its protocols describe.

Parses the source with `ast` (nothing is imported), so it runs in well under a second.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lorafleet"

# Leaf utilities any layer may use: they import no other lorafleet layer.
_LEAVES = frozenset({"fsio", "hardware"})

# Layers that import no other lorafleet layer at all (the leaves, and the pure canary).
PURE = _LEAVES | {"canary"}

# Layer -> the layers it may import (besides itself and the leaves). A layer is a sub-package
# (lorafleet/model/) or a top-level module (lorafleet/canary.py). Keep in step with
# docs/architecture.md.
ALLOWED: dict[str, frozenset[str]] = {
    "fsio": frozenset(),
    "hardware": frozenset(),
    "canary": frozenset(),
    "model": frozenset(),
    "adapters": frozenset({"model"}),
    "train": frozenset({"model", "adapters", "canary"}),
    "sample": frozenset({"model", "adapters", "canary"}),
    "interfaces": frozenset(),  # run time; type-only imports: INTERFACES_MAY_NAME
    "distributed": frozenset({"interfaces", "train", "sample", "model", "adapters", "canary"}),
    "verification": frozenset(
        {"interfaces", "distributed", "train", "sample", "model", "adapters", "canary"}
    ),
    "engines": frozenset(
        {
            "interfaces",
            "verification",
            "sync",
            "distributed",
            "train",
            "sample",
            "model",
            "adapters",
            "canary",
        }
    ),
    "sync": frozenset({"interfaces", "canary", "sample", "model", "adapters"}),
    "server": frozenset(
        {
            "engines",
            "verification",
            "interfaces",
            "sync",
            "train",
            "sample",
            "model",
            "adapters",
            "canary",
        }
    ),
    "rl": frozenset({"server", "engines", "model"}),
    "export": frozenset({"sync", "adapters", "model"}),
}
# What `interfaces` may name under TYPE_CHECKING: the layers whose types the protocols mention.
INTERFACES_MAY_NAME = frozenset({"canary", "model", "adapters", "train", "sample"})
# The entry points sit on top and may import any layer.
TOP = frozenset({"cli", "demo"})

# Known exceptions: (importer file relative to lorafleet/, imported layer) -> why it is still
# there. The rule stays as documented; each allowance must still be needed (see the last test).
ALLOWANCES: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    file: str  # relative to lorafleet/
    line: int
    importer: str  # layer
    target: str  # layer
    module: str  # the imported module, dotted
    type_only: bool


def _layer_of(module: str) -> str | None:
    """`lorafleet.model.banks` -> "model", `lorafleet.canary` -> "canary"; None outside."""
    parts = module.split(".")
    if parts[0] != "lorafleet" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _type_only_lines(tree: ast.AST) -> set[int]:
    """Line numbers of statements inside `if TYPE_CHECKING:` bodies."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                for inner in ast.walk(stmt):
                    if hasattr(inner, "lineno"):
                        lines.add(inner.lineno)
    return lines


def _imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted lorafleet modules one import statement (or importlib call) reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source == "lorafleet":  # `from lorafleet import canary`: each name is a layer
            return [f"lorafleet.{alias.name}" for alias in node.names]
        return [source]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


@functools.cache
def collect_imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        importer = _layer_of(module)
        if importer is None:  # lorafleet/__init__.py
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        type_only = _type_only_lines(tree)
        for node in ast.walk(tree):
            for target_module in _imported_modules(node, module, path.name == "__init__.py"):
                target = _layer_of(target_module)
                if target is None or target == importer:
                    continue
                line = getattr(node, "lineno", 0)
                found.append(
                    Import(
                        file=str(path.relative_to(PACKAGE)),
                        line=line,
                        importer=importer,
                        target=target,
                        module=target_module,
                        type_only=line in type_only,
                    )
                )
    return tuple(found)


def _breaks_rule(imp: Import) -> str | None:
    """Why `imp` breaks the layering, or None when it is allowed."""
    if imp.importer in TOP:
        return None
    if imp.target in TOP:
        return f"nothing imports the entry point {imp.target}"
    if imp.importer in PURE:
        return f"{imp.importer} imports no other lorafleet layer"
    if imp.target in _LEAVES:
        return None
    if imp.target == "interfaces" and imp.type_only:
        return None  # any layer may name a seam's type; see the module docstring
    if imp.importer == "interfaces":
        if not imp.type_only:
            return "interfaces imports other layers only under TYPE_CHECKING"
        if imp.target in INTERFACES_MAY_NAME:
            return None
        return f"interfaces may name only {sorted(INTERFACES_MAY_NAME)} under TYPE_CHECKING"
    if imp.importer not in ALLOWED:
        return (
            f"{imp.importer} is not a layer of docs/architecture.md; add it to ALLOWED and the doc"
        )
    allowed = ALLOWED[imp.importer]
    if imp.target in allowed:
        return None
    may = ", ".join(sorted(allowed | _LEAVES)) or "nothing"
    return f"{imp.importer} may import only {may}"


def test_every_import_follows_the_layering():
    broken = []
    for imp in collect_imports():
        why = _breaks_rule(imp)
        if why is None or (imp.file, imp.target) in ALLOWANCES:
            continue
        kind = " (under TYPE_CHECKING)" if imp.type_only else ""
        broken.append(
            f"lorafleet/{imp.file}:{imp.line}: {imp.importer} -> {imp.target} "
            f"(imports {imp.module}){kind}: {why}"
        )
    assert not broken, "imports against docs/architecture.md:\n" + "\n".join(broken)


def test_every_layer_is_documented():
    layers = {imp.importer for imp in collect_imports()} | {
        _layer_of(_module_name(p)) for p in PACKAGE.rglob("*.py")
    }
    layers.discard(None)
    known = set(ALLOWED) | TOP | _LEAVES
    assert layers <= known, f"layers missing from the rules: {sorted(layers - known)}"
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [layer for layer in sorted(known) if f"`{layer}`" not in doc]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_each_allowance_is_still_needed():
    stale = []
    for file, target in sorted(ALLOWANCES):
        hits = [imp for imp in collect_imports() if (imp.file, imp.target) == (file, target)]
        if not any(_breaks_rule(imp) for imp in hits):
            stale.append(f"lorafleet/{file} no longer imports {target} against the rules")
    assert not stale, "drop these allowances:\n" + "\n".join(stale)


def test_the_checker_sees_local_and_type_only_imports(tmp_path):
    """The parser itself: a function-local import and a TYPE_CHECKING one are both found."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from lorafleet.train.engine import TrainEngine\n"
        "def f():\n"
        "    from ..server import app\n"
        "    import importlib\n"
        "    importlib.import_module('lorafleet.sync.base')\n"
    )
    tree = ast.parse(source)
    type_only = _type_only_lines(tree)
    reached = [
        (m, getattr(n, "lineno", 0) in type_only)
        for n in ast.walk(tree)
        for m in _imported_modules(n, "lorafleet.sample.engine", False)
        if m.startswith("lorafleet")
    ]
    assert sorted(reached) == [
        ("lorafleet.server", False),
        ("lorafleet.sync.base", False),
        ("lorafleet.train.engine", True),
    ]
    sample_to_train = Import("sample/engine.py", 3, "sample", "train", "lorafleet.train", True)
    assert (
        _breaks_rule(sample_to_train)
        == "sample may import only adapters, canary, fsio, hardware, model"
    )


# --------------------------------------------------------------------------- the server's stages

SERVER = PACKAGE / "server"
# Stage -> the stages it may import (besides itself). A stage is a sub-package of
# lorafleet/server/; `errors` is server/errors.py; the top-level modules (app, main, service,
# config) assemble the stages and may import any. Keep in step with docs/architecture.md.
SERVER_STAGES: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "state": frozenset({"errors"}),
    "ops": frozenset({"state", "errors"}),
    "engine": frozenset({"ops", "state", "errors"}),
    "http": frozenset({"ops", "state", "errors"}),
    "openai": frozenset({"http", "ops", "state", "errors"}),
    "console": frozenset({"http", "ops", "state", "errors"}),
}
SERVER_TOP = frozenset({"app", "main", "service", "config"})
MAX_SERVER_TOP_MODULES = 12
WEB_PACKAGES = ("fastapi", "starlette", "uvicorn")
NO_WEB = frozenset({"state", "ops", "engine", "errors"})  # they know no HTTP framework


def _server_stage(module: str) -> str | None:
    """`lorafleet.server.ops.intake` -> "ops", `lorafleet.server.errors` -> "errors", a top-level
    module -> "top"; None outside the server."""
    parts = module.split(".")
    if parts[:2] != ["lorafleet", "server"]:
        return None
    if len(parts) == 2 or parts[2] in SERVER_TOP:
        return "top"
    return parts[2]


def _server_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, importer stage, imported module) for every import inside the server."""
    found = []
    for path in sorted(SERVER.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets = _imported_modules(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom) and node.module == "lorafleet.server":
                targets = [f"lorafleet.server.{alias.name}" for alias in node.names]
            for target in targets:
                found.append(
                    (str(path.relative_to(PACKAGE)), getattr(node, "lineno", 0), module, target)
                )
    return found


def test_the_server_stages_import_only_downstream():
    """http (bytes in, ops out) never reaches the engine; the engine and ops never reach http;
    state knows neither; errors is everyone's vocabulary and imports no stage."""
    broken = []
    for file, line, module, target in _server_imports():
        importer, imported = _server_stage(module), _server_stage(target)
        if importer is None or imported is None or importer in ("top", imported):
            continue
        if importer not in SERVER_STAGES:
            broken.append(f"lorafleet/{file}: stage {importer!r} is not in SERVER_STAGES")
        elif imported not in SERVER_STAGES[importer]:
            may = ", ".join(sorted(SERVER_STAGES[importer])) or "no other stage"
            broken.append(
                f"lorafleet/{file}:{line}: {importer} -> {imported} (imports {target}): "
                f"{importer} may import {may}"
            )
    assert not broken, "server imports against docs/architecture.md:\n" + "\n".join(broken)


def test_state_ops_and_engine_know_no_http_framework():
    broken = [
        f"lorafleet/{file}:{line}: imports {target}"
        for file, line, module, target in _server_imports()
        if _server_stage(module) in NO_WEB and target.split(".")[0] in WEB_PACKAGES
    ]
    assert not broken, "\n".join(broken)


def test_the_server_top_level_holds_only_entry_points():
    top = sorted(p.stem for p in SERVER.glob("*.py") if p.stem != "__init__")
    assert len(top) <= MAX_SERVER_TOP_MODULES, top
    stages = sorted(p.name for p in SERVER.iterdir() if (p / "__init__.py").exists())
    assert set(stages) == set(SERVER_STAGES) - {"errors"}, stages
    assert set(top) <= SERVER_TOP | {"errors"}, f"modules beside the stages: {top}"


def _probes(source: str) -> list[str]:
    """Where `source` makes a protocol checkable at run time (`runtime_checkable`), the way an
    optional capability gets probed with `isinstance` and given a made-up default."""
    return [
        f"line {node.lineno}"
        for node in ast.walk(ast.parse(source))
        if (isinstance(node, ast.Name) and node.id == "runtime_checkable")
        or (isinstance(node, ast.Attribute) and node.attr == "runtime_checkable")
    ]


def test_capabilities_are_declared_not_probed():
    """Capabilities are members of the seams that every implementation declares
    (docs/architecture.md, `interfaces`): no protocol in the package is checkable at run time."""
    found = [
        f"lorafleet/{path.relative_to(PACKAGE)} {where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for where in _probes(path.read_text())
    ]
    assert not found, "runtime-checkable protocols (declare the capability instead):\n" + "\n".join(
        found
    )
    assert _probes("import typing\n@typing.runtime_checkable\nclass P(typing.Protocol): ...\n")
