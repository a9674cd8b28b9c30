"""The package's shape in figures: what issue 52's "done when" measures, on the tree as it is.

    python benchmarks/architecture.py             # the static figures
    python benchmarks/architecture.py --trace     # and a parameter's main line, against FSDP2
    python benchmarks/architecture.py --tree DIR  # the same of another checkout (a commit's)

Static figures, read from the source (comments, docstrings and blank lines do not count
as code lines):

- modules over 600 code lines and classes over 350;
- the engine's folders and how many modules each holds (its ``__init__`` counted);
- the files whose code names the quantized mode, and those naming offload (identifiers and
  strings matching ``QUANTIZED`` and ``OFFLOAD`` below; comments and docstrings do not
  count, a mention in prose is not a dependency);
- the files that register a hook with torch (a call of ``register_*hook*``, or autograd's
  ``queue_callback``).

``--trace`` follows one parameter, ``blocks.0.qkv.weight`` of a small GPT at two ranks,
from ``sw.shard`` through a forward, a backward and ``optimizer.step()``, and counts the
package's files whose functions are handed it: a call whose arguments hold the parameter,
one of the tensors standing for it (its shard, its full form), its record, or the group
or unit holding it. The same is counted for FSDP2's ``fully_shard`` on the same model
(the parameter, its ``FSDPParam`` and its tensors, its ``FSDPParamGroup``), in
torch/distributed/fsdp/_fully_shard/.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import pathlib
import re
import sys
import tempfile
import tokenize
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "shardwise"
MAX_MODULE, MAX_CLASS, MAX_FOLDER = 600, 350, 12
QUANTIZED = re.compile(r"quantiz|packed|nf4", re.I)
OFFLOAD = re.compile(r"offload", re.I)
HOOK_CALL = re.compile(r"^register_\w*hook\w*$|^queue_callback$")
TRACKED = "blocks.0.qkv.weight"


def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers of every docstring in ``tree``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return lines


def code_lines(source: str) -> set[int]:
    """Lines holding code: a token other than a comment, outside docstrings."""
    docs = docstring_lines(ast.parse(source))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return lines


def modules() -> Iterator[tuple[str, str]]:
    """(path in the package, source) of every module."""
    for f in sorted(PKG.rglob("*.py")):
        yield f.relative_to(PKG).as_posix(), f.read_text()


def sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code lines, module) and (code lines, module:Class) for every module and class."""
    mods, classes = [], []
    for name, src in modules():
        code = code_lines(src)
        mods.append((len(code), name))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                inside = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
                classes.append((len(code & inside), f"{name}:{node.name}"))
    return sorted(mods, reverse=True), sorted(classes, reverse=True)


def folders() -> dict[str, int]:
    """The engine's folders and the modules each holds."""
    out: dict[str, int] = {}
    for f in (PKG / "engine").rglob("*.py"):
        key = f.parent.relative_to(PKG).as_posix()
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def names_in_code(source: str) -> set[str]:
    """Identifiers, attribute names and string constants of ``source``'s code (docstrings
    left out)."""
    tree = ast.parse(source)
    docs = docstring_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
            if node.asname:
                found.add(node.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(node.module.split("."))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.lineno not in docs):
            found.add(node.value)
    return found


def files_naming(pattern: re.Pattern[str]) -> list[str]:
    return [name for name, src in modules()
            if any(pattern.search(n) for n in names_in_code(src))]


def hook_sites() -> dict[str, int]:
    """Files calling torch's hook registrations, with the number of calls."""
    out: dict[str, int] = {}
    for name, src in modules():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if HOOK_CALL.match(called):
                    out[name] = out.get(name, 0) + 1
    return out


def static_report() -> None:
    mods, classes = sizes()
    print(f"modules: {len(mods)}; code lines: {sum(n for n, _ in mods)}")
    print(f"largest modules (bound {MAX_MODULE} code lines):")
    for n, name in mods[:6]:
        print(f"  {n:5d}  {name}{'   OVER' if n > MAX_MODULE else ''}")
    print(f"largest classes (bound {MAX_CLASS} code lines):")
    for n, name in classes[:6]:
        print(f"  {n:5d}  {name}{'   OVER' if n > MAX_CLASS else ''}")
    print(f"engine folders (bound {MAX_FOLDER} modules, __init__ counted):")
    for d, n in folders().items():
        print(f"  {n:5d}  {d}{'   OVER' if n > MAX_FOLDER else ''}")
    for label, pattern in (("the quantized mode", QUANTIZED), ("offload", OFFLOAD)):
        found = files_naming(pattern)
        print(f"files naming {label}: {len(found)}")
        print("  " + ", ".join(found))
    sites = hook_sites()
    print(f"files registering hooks with torch: {len(sites)}")
    for name, n in sorted(sites.items()):
        print(f"  {n:5d}  {name}")


# ---- --trace: a parameter's main line ------------------------------------------------------


def _holds(value: object, ours: list[object], depth: int = 0) -> bool:
    if any(value is o for o in ours):
        return True
    if depth == 0 and isinstance(value, (list, tuple)) and len(value) <= 64:
        return any(_holds(v, ours, 1) for v in value)
    return False


_MODULE_HOOKS = ["register_forward_pre_hook", "register_forward_hook",
                 "register_full_backward_pre_hook", "register_full_backward_hook",
                 "register_state_dict_pre_hook", "register_state_dict_post_hook",
                 "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook"]
_TENSOR_HOOKS = ["register_hook", "register_post_accumulate_grad_hook"]
_OPTIMIZER_HOOKS = ["register_step_pre_hook", "register_step_post_hook",
                    "register_state_dict_pre_hook", "register_state_dict_post_hook",
                    "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook"]
_GLOBAL_HOOKS = ["register_optimizer_step_pre_hook", "register_optimizer_step_post_hook"]


def _watch_registrations(pkg: str, phase: list[str], log: list[tuple[str, str, bool]]) -> None:
    """Wrap torch's hook registrations so that each call made from the package is logged:
    (phase, the calling file, whether ``engine.build`` is on the stack)."""
    import torch
    import torch.nn as nn
    import torch.optim.optimizer as optim_mod

    def wrap(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def registering(*args: object, **kwargs: object) -> object:
            frame = sys._getframe(1)
            caller = frame.f_code.co_filename
            if caller.startswith(pkg):
                stack, f = [], frame
                while f is not None:
                    stack.append(f.f_code.co_filename)
                    f = f.f_back
                in_build = any(s.endswith(os.path.join("engine", "build.py")) for s in stack)
                log.append((phase[0], os.path.relpath(caller, pkg), in_build))
            return original(*args, **kwargs)

        setattr(owner, name, registering)

    for n in _MODULE_HOOKS:
        wrap(nn.Module, n)
    for n in _TENSOR_HOOKS:
        wrap(torch.Tensor, n)
    for n in _OPTIMIZER_HOOKS:
        wrap(torch.optim.Optimizer, n)
    for n in _GLOBAL_HOOKS:
        wrap(optim_mod, n)


def _trace_rank(rank: int, world: int, init: str, system: str, out: str, pkg: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path.insert(0, str(pathlib.Path(pkg).parent))
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.models import GPT, GPTConfig

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    original = dict(model.named_parameters())[TRACKED]
    ours: list[object] = [original]
    assert pathlib.Path(sw.__file__).parent == pathlib.Path(pkg), sw.__file__
    roots = {"shardwise": pkg,
             "fsdp2": str(pathlib.Path(torch.__file__).parent / "distributed" / "fsdp"
                          / "_fully_shard")}
    root = roots[system]
    seen: dict[str, int] = {}
    phase = ["shard"]
    registered: list[tuple[str, str, bool]] = []
    if system == "shardwise":
        _watch_registrations(pkg, phase, registered)

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(root):
            return
        args = frame.f_code.co_varnames[: frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
        if any(_holds(frame.f_locals.get(a), ours) for a in args):
            rel = os.path.relpath(f, root)
            seen[rel] = seen.get(rel, 0) + 1

    def learn() -> None:
        """Add what stands for the parameter once it exists (its shard, record, group...)."""
        if system == "shardwise":
            try:
                from shardwise.engine.iteration.unit import sharded_param
            except ImportError:  # a tree from before the engine's rooms (issue 52)
                from shardwise.engine.unit import sharded_param  # type: ignore[no-redef]
            shard = dict(model.named_parameters())[TRACKED]
            sp = sharded_param(shard)
            assert sp is not None
            ours.extend([shard, sp, sp.full, sp.local, sp.group, sp.unit])
        else:
            from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
            shard = dict(model.named_parameters())[TRACKED]
            for m in model.modules():
                state = _get_module_fsdp_state(m)
                group = state and state._fsdp_param_group
                for fp in (group.fsdp_params if group else []):
                    if fp.sharded_param is shard:
                        ours.extend([shard, fp, group])

    def shard() -> None:
        if system == "shardwise":
            sw.shard(model, units=type(model.blocks[0]))
        else:
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)

    x = torch.randint(0, 64, (2, 16))
    sys.setprofile(profile)
    shard()
    sys.setprofile(None)
    learn()
    phase[0] = "iteration"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sys.setprofile(profile)
    loss = model(x, x)
    loss.backward()
    opt.step()
    sys.setprofile(None)
    if rank == 0:
        lines = [f"{n} {f}" for f, n in sorted(seen.items())]
        lines += [f"hook {ph} {f} {int(b)}" for ph, f, b in registered]
        pathlib.Path(out).write_text("\n".join(lines))
    dist.destroy_process_group()


def trace(system: str) -> tuple[list[tuple[str, int]], list[tuple[str, str, bool]]]:
    """The files ``TRACKED``'s main line crosses (with the calls handed it), and the hook
    registrations made by the package (phase, calling file, made under ``engine.build``)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seen.txt")
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.start_processes(_trace_rank, args=(2, init, system, out, str(PKG)), nprocs=2,
                           start_method="spawn")
        lines = pathlib.Path(out).read_text().splitlines()
    files = [(f, int(n)) for n, f in (x.split(" ", 1) for x in lines if not x.startswith("hook "))]
    hooks = [(ph, f, b == "1") for _, ph, f, b in (x.split(" ") for x in lines
                                                   if x.startswith("hook "))]
    return files, hooks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="store_true",
                    help="also follow one parameter from shard to the optimizer step")
    ap.add_argument("--tree", type=pathlib.Path, default=ROOT,
                    help="the checkout to measure (default: this one)")
    args = ap.parse_args()
    global PKG
    PKG = args.tree.resolve() / "src" / "shardwise"
    print(f"tree: {args.tree.resolve()}")
    static_report()
    if args.trace:
        for system in ("shardwise", "fsdp2"):
            files, hooks = trace(system)
            print(f"{system}: {TRACKED}'s main line crosses {len(files)} files "
                  f"(calls handed it, by file):")
            for f, n in files:
                print(f"  {n:5d}  {f}")
            for ph in ("shard", "iteration"):
                made = [(f, b) for p, f, b in hooks if p == ph]
                if system != "shardwise" or not made:
                    continue
                by_file: dict[str, int] = {}
                for f, _ in made:
                    by_file[f] = by_file.get(f, 0) + 1
                outside = sum(1 for _, b in made if not b)
                print(f"hooks registered with torch during {ph}: {len(made)}, from "
                      f"{len(by_file)} files; {len(made) - outside} under engine.build, "
                      f"{outside} not:")
                for f, n in sorted(by_file.items()):
                    print(f"  {n:5d}  {f}")


if __name__ == "__main__":
    main()
