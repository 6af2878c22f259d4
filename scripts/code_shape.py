"""Prints the shape of the package: the longest functions, the largest classes and the
import graph between lorafleet's sub-packages (the figures an architecture review asks for).

    .venv/bin/python scripts/code_shape.py [--top 10]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "lorafleet"


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else (parts[1] if len(parts) == 2 else parts[0])


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    functions: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    edges: set[tuple[str, str]] = set()
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text())
        src_pkg = _package_of(module) if "." in module else "lorafleet"
        if module.count(".") == 1 and path.name != "__init__.py":
            src_pkg = module.split(".")[1]  # a top-level module is its own node
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((n, f"{module}:{node.name} (line {node.lineno})"))
            elif isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                classes.append((n, f"{module}.{node.name} (line {node.lineno})"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                target = node.module
                if target.startswith("lorafleet."):
                    edges.add((src_pkg, target.split(".")[1]))
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                if target.startswith("lorafleet."):
                    edges.add((src_pkg, target.split(".")[1]))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("lorafleet."):
                        edges.add((src_pkg, alias.name.split(".")[1]))
    print(f"## {args.top} longest functions (lines)")
    for n, name in sorted(functions, reverse=True)[: args.top]:
        print(f"{n:5d}  {name}")
    print(f"\n## {args.top} largest classes (lines)")
    for n, name in sorted(classes, reverse=True)[: args.top]:
        print(f"{n:5d}  {name}")
    print("\n## package import edges (importer -> imported)")
    for a, b in sorted(edges):
        if a != b:
            print(f"{a} -> {b}")


if __name__ == "__main__":
    main()
