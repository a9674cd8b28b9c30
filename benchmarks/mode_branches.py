"""Count the files that branch on a mode outside the mode's own package (issue 42, item 5).

A *branch on a mode* is the test of an ``if``/``elif``, a ``while``, a conditional
expression (``a if t else b``) or a comprehension's ``if`` filter that names the mode:
some identifier in the test (a variable, an attribute, a function called) whose
lower-cased spelling

- for the reproducible mode, contains ``exact`` or ``reproducible`` (``g.exact``,
  ``settings.reproducible``, ``isinstance(r, ExactReduction)``);
- for offload, contains ``offload``, ``tier``, ``disk`` or ``groupstorage``, or is
  ``store`` or ``placement`` (``g.store``, ``placement.optimizer``, ``on_disk``; not
  DTensor's ``placements``, and not ``store`` in ``shardwise/comm/``, where it is the
  rendezvous store).

A file counts once per mode however many such tests it holds. The mode's own package is
left out: ``shardwise/exact/`` for the reproducible mode, ``shardwise/engine/offload/`` for
offload. Docstrings, comments and error messages never count (only test expressions are
read), and neither does passing a mode on (``exact=exact``): only choosing by it.

It also reports the files that merely *name* the mode in code (any identifier as above,
a test or not), a looser count. Run: ``python benchmarks/mode_branches.py [COMMIT] [-v]``
(the working tree without a commit; ``-v`` lists the branching files).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = {
    "reproducible": (("exact", "reproducible"), (), "shardwise/exact/"),
    "offload": (("offload", "tier", "disk", "groupstorage"), ("store", "placement"),
                "shardwise/engine/offload/"),
}
# Where a mode's word means something else.
ELSEWHERE = {("offload", "store"): "shardwise/comm/"}


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


def _counts(mode: str, ident: str, path: str) -> bool:
    parts, whole, _ = MODES[mode]
    other = ELSEWHERE.get((mode, ident.lower()))
    return _names_mode(ident, parts, whole) and not (other and other in path)


def branching_files(sources: dict[str, str], anywhere: bool = False
                    ) -> dict[str, list[str]]:
    """For each mode, the files (paths under src/) outside its package that branch on it
    (``anywhere``: that name it in any code, not only in a test)."""
    found: dict[str, list[str]] = {m: [] for m in MODES}
    for path, text in sorted(sources.items()):
        tree = ast.parse(text)
        idents = _identifiers(tree) if anywhere else set().union(
            *(_identifiers(t) for t in _tests(tree)))
        for mode, (_, _, home) in MODES.items():
            if home not in path and any(_counts(mode, i, path) for i in idents):
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
    sources = sources_at(args[0] if args else None)
    branching, naming = branching_files(sources), branching_files(sources, anywhere=True)
    for mode in MODES:
        print(f"{mode}: {len(branching[mode])} files branch on it, "
              f"{len(naming[mode])} name it")
        if verbose:
            for f in branching[mode]:
                print(f"  {f}")


if __name__ == "__main__":
    main(sys.argv[1:])
