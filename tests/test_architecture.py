"""The package's architecture, kept by CI: layers that only import downwards, and the
layout table of docs/architecture.md generated from the modules' docstrings.

Run ``python tests/test_architecture.py --write`` to regenerate that table after adding,
moving or re-describing a module.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
LAYOUT_PAGE = SRC.parent / "docs" / "architecture.md"
BEGIN, END = "<!-- layout: begin -->", "<!-- layout: end -->"

# Bottom to top. A module may import from its own layer and the layers below it, never
# from one above. Every module must belong to a layer: a new top-level module is a
# decision about where it sits, made here.
LAYERS: list[tuple[str, str, list[str]]] = [
    ("base", "errors and argument checks, environment switches, the logger, what is "
             "attached to modules",
     ["shardwise.errors", "shardwise._args", "shardwise._env", "shardwise._log",
      "shardwise._registry", "shardwise._fs"]),
    ("comm", "collectives, process groups and meshes, the checks riding on them",
     ["shardwise.comm"]),
    ("exact", "the reproducible mode's arithmetic", ["shardwise.exact"]),
    # The engine's three rooms (issue 52, item 4), then its top: the build, which puts
    # them together.
    ("engine: groups", "a group of parameters and how it moves: layout, copies, storage, "
                       "offload, reduction",
     ["shardwise.engine.groups"]),
    ("engine: iteration", "one iteration: units, phases, hooks, prefetch, buffers",
     ["shardwise.engine.iteration"]),
    ("engine: entry points", "what torch sees: the step, zero_grad, casts, the state dict, "
                             "refusals",
     ["shardwise.engine.entry_points"]),
    ("engine", "the engine's top: the plan it is given and the build that puts the rooms "
               "together",
     ["shardwise.engine"]),
    ("planning", "units, memory and communication decided before building",
     ["shardwise.planning"]),
    ("operations", "the public operations on a sharded model",
     ["shardwise.sharding", "shardwise.gather", "shardwise.grads", "shardwise.consistency",
      "shardwise.inspection", "shardwise.models", "shardwise.checkpoint",
      "shardwise.streaming"]),
    ("applications", "the public package, the command line, the demo, integrations",
     ["shardwise", "shardwise.cli", "shardwise.demo", "shardwise.integrations"]),
]


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    out = {}
    for f in sorted((SRC / "shardwise").rglob("*.py")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def layer_of(module: str) -> int:
    """Index in LAYERS of the most specific prefix naming ``module``."""
    best, length = -1, -1
    for i, (_, _, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    return best


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules ``name`` imports, anywhere in it (functions and
    ``if TYPE_CHECKING:`` blocks too: a type-only import still says who knows whom)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import submodule` imports the submodule, not the package.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def test_every_module_belongs_to_a_layer():
    homeless = [m for m in modules() if layer_of(m) < 0]
    assert not homeless, f"modules outside every layer (add them to LAYERS): {homeless}"


def test_no_module_imports_from_a_layer_above_its_own():
    known = modules()
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, path in known.items() for t in sorted(imports(m, path, known))
              if layer_of(t) > layer_of(m)]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_layer_test_sees_an_upward_import(tmp_path):
    """The check above can fail: an engine module importing the public package is caught."""
    fake = tmp_path / "unit.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from ...sharding import shard\n")
    found = imports("shardwise.engine.iteration.unit", fake, modules())
    assert found == {"shardwise.sharding"}
    assert layer_of("shardwise.sharding") > layer_of("shardwise.engine.iteration.unit")


def test_the_layer_test_sees_a_room_reaching_up(tmp_path):
    """The rooms' order can fail: a group importing the unit that holds it (a room
    above), or the iteration importing a refusal of the entry points, is caught."""
    known = modules()
    fake = tmp_path / "flat.py"
    fake.write_text("from ..iteration.unit import Unit\n")
    found = imports("shardwise.engine.groups.flat", fake, known)
    assert found == {"shardwise.engine.iteration.unit"}
    assert layer_of("shardwise.engine.iteration.unit") > layer_of("shardwise.engine.groups.flat")
    fake.write_text("from ..entry_points.guards import check_step\n")
    found = imports("shardwise.engine.iteration.state", fake, known)
    assert found == {"shardwise.engine.entry_points.guards"}
    assert layer_of("shardwise.engine.entry_points.guards") > layer_of(
        "shardwise.engine.iteration.state")
    assert layer_of("shardwise.engine.build") > layer_of("shardwise.engine.entry_points.step")


# Issue 52's bound on a room: a newcomer reads a folder of at most 12 modules (its
# __init__ counted).
MAX_MODULES_PER_FOLDER = 12


def test_no_engine_folder_holds_more_than_twelve_modules():
    folders: dict[pathlib.Path, int] = {}
    for f in (SRC / "shardwise" / "engine").rglob("*.py"):
        folders[f.parent] = folders.get(f.parent, 0) + 1
    big = {str(d.relative_to(SRC)): n for d, n in folders.items()
           if n > MAX_MODULES_PER_FOLDER}
    assert len(folders) >= 4, f"the engine's rooms were not found: {sorted(folders)}"
    assert not big, f"engine folders over {MAX_MODULES_PER_FOLDER} modules: {big}"


OFFLOAD = "shardwise.engine.groups.offload"
# What the offload package may take from the engine: the allocator, and from the groups'
# parts the interfaces it implements and the one fact its step shares with the plain step.
OFFLOAD_TAKES = {"shardwise.engine.groups.alloc": None,  # anything
                 "shardwise.engine.groups.parts": {"Placement", "ShardStorage",
                                                   "OptimizerStep", "PER_PARAMETER"}}


def names_taken(name: str, path: pathlib.Path, target: str) -> set[str]:
    """The names ``name``'s ``from ... import`` statements take from module ``target``."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    taken: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = (".".join(here[: len(here) - (node.level - 1)]
                            + ([node.module] if node.module else []))
                   if node.level else node.module or "")
            if mod == target:
                taken.update(a.name for a in node.names)
    return taken


def test_offload_sits_below_the_groups():
    """Inside the engine, the offload package is a part the groups are given
    (engine/groups/parts.py): it imports nothing of the engine but the allocator and, of
    the parts, the interfaces it implements (``Placement``, ``ShardStorage``,
    ``OptimizerStep``) and ``PER_PARAMETER``; never the units or groups that use it
    (issue 42, item 7)."""
    known = modules()
    upward = []
    for m, path in known.items():
        if not m.startswith(OFFLOAD):
            continue
        for t in sorted(imports(m, path, known)):
            if not t.startswith("shardwise.engine.") or t.startswith(OFFLOAD):
                continue
            if t not in OFFLOAD_TAKES:
                upward.append(f"{m} imports {t}")
                continue
            extra = names_taken(m, path, t) - (OFFLOAD_TAKES[t] or names_taken(m, path, t))
            if extra:
                upward.append(f"{m} takes {sorted(extra)} from {t}")
    assert not upward, "offload reaches up into the engine:\n" + "\n".join(upward)


def test_the_engine_asks_a_placement_and_names_no_tier():
    """Issue 52: outside the offload package the engine imports nothing of it; it asks a
    ``Placement`` (engine/groups/parts.py) for a group's storage and its part of the step.
    Only the layers above it (``sharding``, the planner, the public names) import it."""
    known = modules()
    inside = [f"{m} imports {t}" for m, path in known.items()
              if m.startswith("shardwise.engine.") and not m.startswith(OFFLOAD)
              for t in sorted(imports(m, path, known)) if t.startswith(OFFLOAD)]
    assert not inside, "engine modules importing offload:\n" + "\n".join(inside)


# Issue 42, item 3: the operations on a sharded model ask a unit's groups through their
# interface (Note [one interface for a group] in engine/groups/interface.py), never the engine's
# internals: a group's offload storage, a tier's placement, the unit's state enum, or
# which kind of group it is.
GROUP_INTERNALS = {"store", "UnitState", "FlatGroup", "PackedGroup", "GroupStorage",
                   "placement", "Placement", "Tiers", "OptimizerStep"}
THROUGH_THE_INTERFACE = ["shardwise.checkpoint", "shardwise.inspection", "shardwise.grads",
                         "shardwise.gather", "shardwise.consistency"]


def internals_named(path: pathlib.Path) -> set[str]:
    """The group internals (GROUP_INTERNALS) ``path``'s code names: as a variable, an
    attribute (``x.store``) or an imported name; strings and comments do not count."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.split(".")[-1])
    return found & GROUP_INTERNALS


def test_operations_ask_the_groups_not_their_internals():
    named = {m: sorted(internals_named(p)) for m, p in modules().items()
             if any(m == t or m.startswith(t + ".") for t in THROUGH_THE_INTERFACE)}
    offenders = {m: n for m, n in named.items() if n}
    assert len(named) >= 10, f"the modules to check were not found: {sorted(named)}"
    assert not offenders, f"modules naming a group's internals: {offenders}"


def test_the_internals_test_sees_a_planted_name(tmp_path):
    """The check above can fail: a checkpoint module reading a group's storage, its
    tier, the unit's state enum, or importing a group class, is caught; a docstring
    saying so is not."""
    fake = tmp_path / "io.py"
    fake.write_text('"""Reads group.store."""\n'
                    "from ..engine.unit import FlatGroup, UnitState\n"
                    "def f(t):\n"
                    "    if t.sharded.group.store is not None:\n"
                    "        return t.sharded.group.placement.optimizer\n")
    assert internals_named(fake) == {"FlatGroup", "UnitState", "store", "placement"}
    clean = tmp_path / "clean.py"
    clean.write_text('"""Never names group.store."""\nx = "FlatGroup"\n')
    assert internals_named(clean) == set()


def summary(path: pathlib.Path) -> str:
    """The docstring's first paragraph, in Markdown."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    first = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", first).replace("``", "`")
    return first.replace("|", "\\|")


def group_of(module: str) -> str:
    """The package a module belongs to directly under ``shardwise`` (itself at the top)."""
    return ".".join(module.split(".")[:2])


def layout_table() -> str:
    """The layout table of docs/architecture.md: one row per module, by layer; within a
    layer the packages, and within a package the modules, in dependency order (a package's
    own docstring first)."""
    known = modules()
    rows = ["| layer | module | what it is |", "|---|---|---|"]
    for i, (layer, about, _) in enumerate(LAYERS):
        names = sorted(m for m in known if layer_of(m) == i)
        groups = sorted({group_of(m) for m in names})
        group_deps = {g: {group_of(t) for m in names if group_of(m) == g
                          for t in imports(m, known[m], known)} - {g} for g in groups}
        rows.append(f"| **{layer}** | | *{about}* |")
        for g in _ordered(groups, group_deps):
            members = [m for m in names if group_of(m) == g]
            inner = {m: imports(m, known[m], known) & set(members) - {g} for m in members}
            ordered = _ordered(members, inner)
            if g in ordered and g != "shardwise":
                ordered.remove(g)
                ordered.insert(0, g)
            for m in ordered:
                rel = known[m].relative_to(SRC / "shardwise").as_posix()
                rows.append(f"| | `{rel}` | {summary(known[m])} |")
    return "\n".join(rows)


def _ordered(names: list[str], deps: dict[str, set[str]]) -> list[str]:
    """``names`` with each after the ones it depends on (ties by name)."""
    done: list[str] = []
    while len(done) < len(names):
        ready = sorted(n for n in names if n not in done and deps[n] & set(names) <= set(done))
        if not ready:  # an import loop (test_no_import_loops reports it): keep the rest stable
            ready = sorted(n for n in names if n not in done)[:1]
        done.append(ready[0])
    return done


def test_layout_table_is_current():
    text = LAYOUT_PAGE.read_text()
    assert BEGIN in text and END in text, (
        f"docs/architecture.md lacks the {BEGIN} ... {END} markers")
    current = text.split(BEGIN)[1].split(END)[0].strip()
    assert current == layout_table(), (
        "docs/architecture.md's layout table is out of date: run python tests/test_architecture.py "
        "--write")


def test_every_module_says_what_it_is():
    missing = [m for m, p in modules().items() if not summary(p)]
    assert not missing, (
        f"modules without a docstring (docs/architecture.md's table needs one): {missing}")


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of ``graph`` (module -> the modules it imports): each a sorted list
    of modules that import one another, directly or through others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            members = stack[stack.index(m):]
            del stack[stack.index(m):]
            if len(members) > 1:
                loops.append(sorted(members))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(loops)


def test_no_import_loops():
    known = modules()
    loops = import_loops({m: imports(m, p, known) - {m} for m, p in known.items()})
    assert not loops, "modules that import one another:\n" + "\n".join(map(str, loops))


def test_the_loop_test_sees_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set()}
    assert import_loops(graph) == [["a", "b", "c"]]


# A Note is named where a line starts with it (``# Note [name]``, or in a docstring);
# every mention elsewhere, in the package, the tests and the docs, must name one.
_NOTE_NAMED = re.compile(r'^\s*(?:#\s*)?(?:""")?Note \[([^\]]+)\]', re.M)
_NOTE_MENTION = re.compile(r"Note\s+\[([^\]]+)\]")


def unnamed_notes(named_in: list[str], mentioned_in: list[str]) -> list[str]:
    """The Notes mentioned in ``mentioned_in`` (texts) that no text of ``named_in`` names."""
    named = {" ".join(m.group(1).split()) for t in named_in for m in _NOTE_NAMED.finditer(t)}
    # A mention may wrap across comment lines: the comment marks are taken out first.
    mentions = {" ".join(m.group(1).split()) for t in mentioned_in
                for m in _NOTE_MENTION.finditer(re.sub(r"(?m)^\s*#", " ", t))}
    return sorted(mentions - named)


def test_every_note_mentioned_is_named():
    sources = [p.read_text() for p in sorted((SRC / "shardwise").rglob("*.py"))]
    tests = [p for p in sorted((SRC.parent / "tests").glob("*.py"))
             if p.name != "test_architecture.py"]  # this file's examples name none
    others = [p.read_text() for p in [*tests, *sorted((SRC.parent / "docs").glob("*.md")),
                                      SRC.parent / "README.md"]]
    # The test suite's own notes (the harness's) are named in tests/.
    harness = [p.read_text() for p in tests]
    missing = unnamed_notes(sources + harness, sources + others)
    assert not missing, f"Notes mentioned but named nowhere in src/shardwise or tests/: {missing}"


def test_the_note_test_sees_an_unnamed_note():
    named = "# Note [one]\n# why\n"
    assert unnamed_notes([named], ["see Note [one] and Note\n# [two]"]) == ["two"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    text = LAYOUT_PAGE.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    LAYOUT_PAGE.write_text(f"{head}{BEGIN}\n{layout_table()}\n{END}{tail}")


# A mention "Note [x] in engine/y.py" sends a reader to a file: it must be the one naming
# the Note (a move of files or of a Note leaves such mentions behind, silently).
_NOTE_WHERE = re.compile(r"Note\s+\[([^\]]+)\]\s+(?:in|\()\s*`?((?:[\w]+/)*[\w]+\.py)`?")


def misplaced_notes(files: dict[str, str], mentioned_in: list[str]) -> list[str]:
    """The mentions "Note [x] in path" in ``mentioned_in`` whose path (relative to the
    package, or to the repository) names no such Note; ``files`` maps paths to texts."""
    wrong = []
    # The package's own top-level names (its folders and modules): a path starting with
    # one is the package's, and a file of it that does not exist is a stale mention (a
    # moved or deleted module), not a file outside the package.
    ours = {p.split("/")[2] for p in files if p.startswith("src/shardwise/")}
    for text in mentioned_in:
        for m in _NOTE_WHERE.finditer(re.sub(r"(?m)^\s*#", " ", text)):
            name, where = " ".join(m.group(1).split()), m.group(2)
            candidates = [t for p, t in files.items()
                          if p == where or p.endswith("/" + where)]
            if not candidates:
                inside = where.removeprefix("src/shardwise/").split("/")[0] in ours
                if inside and "/" in where.removeprefix("src/shardwise/"):
                    wrong.append(f"Note [{name}] in {where} (no such file)")
                continue  # a file outside the package (torch's, a test's): not checked
            named = {" ".join(n.group(1).split()) for t in candidates
                     for n in _NOTE_NAMED.finditer(t)}
            if name not in named:
                wrong.append(f"Note [{name}] in {where}")
    return sorted(set(wrong))


def test_every_note_is_where_its_mentions_say():
    root = SRC.parent
    files = {p.relative_to(root).as_posix(): p.read_text()
             for p in sorted((SRC / "shardwise").rglob("*.py"))}
    texts = [*files.values(),
             *[p.read_text() for p in sorted((root / "tests").glob("*.py"))
               if p.name != "test_architecture.py"],
             *[p.read_text() for p in sorted((root / "docs").glob("*.md"))],
             (root / "README.md").read_text()]
    wrong = misplaced_notes(files, texts)
    assert not wrong, "Notes mentioned in a file that does not name them:\n" + "\n".join(wrong)


def test_the_note_place_test_sees_a_moved_note():
    files = {"src/shardwise/engine/a.py": "# Note [one]\n# why\n", "src/shardwise/b.py": ""}
    assert misplaced_notes(files, ["see Note [one] in engine/a.py"]) == []
    assert misplaced_notes(files, ["see Note [one] in b.py, and Note [one]\n# (engine/a.py)"]) \
        == ["Note [one] in b.py"]
    # A module that moved or was deleted leaves its mentions behind: they are caught.
    assert misplaced_notes(files, ["see Note [one] in engine/gone.py"]) \
        == ["Note [one] in engine/gone.py (no such file)"]
    assert misplaced_notes(files, ["torch's Note [one] in torch/x/y.py"]) == []
