"""Prints the shape of the package: the longest functions, the largest classes and the
import graph between lorafleet's sub-packages (the figures an architecture review asks for).

    .venv/bin/python scripts/code_shape.py [--top 10] [--under server] [--root DIR]

`--under server` limits the counts to one sub-package; `--root` reads another checkout's
`lorafleet/` (a before/after comparison: `git worktree add /tmp/old <commit>`).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "lorafleet"


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_only_lines(tree: ast.AST) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` bodies (their imports are marked type-only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            for stmt in node.body:
                lines.update(n.lineno for n in ast.walk(stmt) if hasattr(n, "lineno"))
    return lines


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The lorafleet layers (sub-package or top-level module) one import statement reaches."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source == "lorafleet":  # `from lorafleet import canary`
            names = [f"lorafleet.{alias.name}" for alias in node.names]
        else:
            names = [source]
    else:
        return []
    return [name.split(".")[1] for name in names if name.startswith("lorafleet.")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--under", default=None, help="a sub-package of lorafleet, e.g. server")
    parser.add_argument("--root", type=Path, default=ROOT.parent, help="a checkout's root")
    args = parser.parse_args()
    root = args.root.resolve() / "lorafleet"
    functions: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    # (importer, imported) -> True while every import along it is type-only
    edges: dict[tuple[str, str], bool] = {}
    files = sorted((root / args.under if args.under else root).rglob("*.py"))
    lines = sum(len(path.read_text().splitlines()) for path in files)
    print(
        f"{len(files)} modules, {lines} lines under {root.relative_to(root.parent)}/{args.under or ''}"
    )
    for path in files:
        module = _module_name(path, root)
        tree = ast.parse(path.read_text())
        type_only = _type_only_lines(tree)
        src_pkg = module.split(".")[1] if "." in module else "lorafleet"
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((n, f"{module}:{node.name} (line {node.lineno})"))
            elif isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                classes.append((n, f"{module}.{node.name} (line {node.lineno})"))
            for target in _targets(node, module, path.name == "__init__.py"):
                key = (src_pkg, target)
                edges[key] = edges.get(key, True) and node.lineno in type_only
    print(f"## {args.top} longest functions (lines)")
    for n, name in sorted(functions, reverse=True)[: args.top]:
        print(f"{n:5d}  {name}")
    print(f"\n## {args.top} largest classes (lines)")
    for n, name in sorted(classes, reverse=True)[: args.top]:
        print(f"{n:5d}  {name}")
    print("\n## package import edges (importer -> imported; rules: docs/architecture.md)")
    for (a, b), only_types in sorted(edges.items()):
        if a != b:
            print(f"{a} -> {b}" + ("  (TYPE_CHECKING only)" if only_types else ""))


if __name__ == "__main__":
    main()
