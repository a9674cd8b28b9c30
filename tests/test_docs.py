"""Every code block in the README and in docs/ runs, so none can rot.

Conventions (docs/index.md repeats them for writers), per page, in a fresh folder:

* ```` ```python ```` blocks run in order in one namespace, like a notebook, on 2 real
  ranks (gloo) whose working directory is that folder;
* then ```` ```bash ```` blocks run line by line in a shell in the same folder (so they
  see what the python blocks wrote), with this environment's ``shardwise`` on the PATH,
  and each line must exit 0;
* ```` ```text ```` blocks and blocks without a language are output, layouts or launch
  templates for other machines (``torchrun --master_addr 10.0.0.1 ...``): not run.

Files are found by globbing, so a new page is covered without touching this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def _run_python(rank, world, page: str, sources: list[str], workdir: str):
    os.chdir(workdir)
    # What torchrun sets; accelerate reads it (the process group itself already exists).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29557")
    namespace: dict = {"__name__": "__doc__"}
    for i, source in enumerate(sources):
        try:
            exec(compile(source, f"{page} python block {i + 1}", "exec"), namespace)
        except BaseException as e:
            raise AssertionError(f"{page}: python block {i + 1} failed:\n{source}") from e


def test_every_page_has_been_found():
    assert (ROOT / "docs" / "quickstart.md") in PAGES
    for page in PAGES:  # a block without a known language would silently never run
        langs = {lang for lang, _ in FENCE.findall(page.read_text())}
        assert langs <= {"python", "bash", "text"}, f"{page.name}: blocks tagged {langs}"
    without = [p.name for p in PAGES if not (blocks(p, "python") or blocks(p, "bash"))]
    assert set(without) <= REFERENCE_PAGES, f"pages without runnable code: {without}"


# Pages that are reference text with nothing to run: the index, and the contributor's and
# status pages (tables of modules, tests and limits). Every other page shows runnable code.
REFERENCE_PAGES = {"index.md", "architecture.md", "reliability.md", "status.md", "testing.md"}


# Pages whose blocks took 10 s or more in a run of the whole suite, or that train Hugging
# Face models end to end (as the slow integration tests do): `make test-fast` skips them.
SLOW_PAGES = {"checkpoints.md", "integrations.md", "lightning.md", "performance.md",
              "planning.md", "quickstart.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow)
                                  if p.name in SLOW_PAGES else p for p in PAGES],
                         ids=lambda p: p.name)
def test_code_blocks_run(page: Path, tmp_path):
    sources = blocks(page, "python")
    commands = [line for body in blocks(page, "bash") for line in body.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    if not sources and not commands:
        pytest.skip("no code blocks")
    if sources:
        run_ranks(_run_python, 2, page.name, sources, str(tmp_path), timeout=300)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1")
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=300)
        assert done.returncode == 0, (f"{page.name}: `{command}` exited {done.returncode}\n"
                                      f"{done.stdout}\n{done.stderr}")


# Pages whose links are checked: the README, the docs, and the benchmark pages they point to.
LINKED_PAGES = [*PAGES, ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "HISTORY.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a `# comment` in a block is no heading)."""
    return FENCE.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives the page's headings (repeats get -1, -2, ...)."""
    found: set[str] = set()
    for title in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _prose(page), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        repeat = 0
        while (f"{slug}-{repeat}" if repeat else slug) in found:
            repeat += 1
        found.add(f"{slug}-{repeat}" if repeat else slug)
    return found


def test_every_docs_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    targets = {target.split("#")[0] for target in LINK.findall(index)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if p.name != "index.md" and p.name not in targets]
    assert not missing, f"docs pages not linked from docs/index.md: {missing}"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    text = re.sub(r"`[^`\n]*`", "", _prose(page))  # `model.layers[0](x)` is code, no link
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ... : not checked offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {path})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
