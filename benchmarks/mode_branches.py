"""Count the files that branch on a mode outside the mode's own package (issue 42, item 5).

A *branch on a mode* is the test of an ``if``/``elif``, a ``while``, a conditional
expression (``a if t else b``) or a comprehension's ``if`` filter that names the mode:
some identifier in the test (a variable, an attribute, a function called) whose
lower-cased spelling

- for the reproducible mode, contains ``exact`` or ``reproducible``;
- for offload, contains ``offload``, ``placement``, ``tier`` or ``disk``, or is ``store``.

A file counts once per mode however many such tests it holds. The mode's own package is
left out: ``shardwise/exact/`` for the reproducible mode, ``shardwise/engine/offload/`` for
offload. Docstrings, comments and error messages never count (only test expressions are
read), and neither does passing a mode on (``exact=exact``): only choosing by it.

Run: ``python benchmarks/mode_branches.py [COMMIT] [-v]`` (the working tree without a
commit; ``-v`` lists the files).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = {
    "reproducible": (("exact", "reproducible"), (), "shardwise/exact/"),
    "offload": (("offload", "placement", "tier", "disk"), ("store",), "shardwise/engine/offload/"),
}


def _identifiers(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _tests(tree: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.If, ast.While, ast.IfExp)):
            out.append(n.test)
        elif isinstance(n, ast.comprehension):
            out.extend(n.ifs)
    return out


def _names_mode(ident: str, parts: tuple[str, ...], whole: tuple[str, ...]) -> bool:
    low = ident.lower()
    return low in whole or any(p in low for p in parts)


def branching_files(sources: dict[str, str]) -> dict[str, list[str]]:
    """For each mode, the files (paths under src/) outside its package that branch on it."""
    found: dict[str, list[str]] = {m: [] for m in MODES}
    for path, text in sorted(sources.items()):
        tests = _tests(ast.parse(text))
        idents = [_identifiers(t) for t in tests]
        for mode, (parts, whole, home) in MODES.items():
            if home in path:
                continue
            if any(_names_mode(i, parts, whole) for ids in idents for i in ids):
                found[mode].append(path)
    return found


def sources_at(commit: str | None) -> dict[str, str]:
    """Every module under src/shardwise, at ``commit`` or in the working tree."""
    if commit is None:
        return {str(p.relative_to(ROOT / "src")): p.read_text()
                for p in sorted((ROOT / "src" / "shardwise").rglob("*.py"))}
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", commit,
                            "src/shardwise"], check=True, capture_output=True,
                           text=True).stdout.split()
    return {n.removeprefix("src/"): subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:{n}"], check=True, capture_output=True,
        text=True).stdout for n in names if n.endswith(".py")}


def main(argv: list[str]) -> None:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    found = branching_files(sources_at(args[0] if args else None))
    for mode, files in found.items():
        print(f"{mode}: {len(files)} files")
        if verbose:
            for f in files:
                print(f"  {f}")


if __name__ == "__main__":
    main(sys.argv[1:])
