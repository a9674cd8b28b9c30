"""``shardwise run``: torchrun with the settings that restarts and elastic membership need.

Note [launcher defaults]
``shardwise run [torchrun options] SCRIPT [ARGS]`` is ``torchrun`` (it calls
``torch.distributed.run`` in this process, with the same options) with these set when the
user did not set them (an option on the command line or its ``PET_*`` variable, or the
environment variable itself, always wins), each said on stderr before the launch:

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. By default torchrun's agents share one worker
  store for the whole job, and the rank-0 agent publishes its address only in the first
  rendezvous round; an agent arriving in a later round (growing back, a node that starts
  late) then waits for it until it fails, and a shrink fails in torch's rendezvous in some
  runs (3 of 7 measured with two agents on one machine). With the setting every round
  publishes a fresh store (docs/long-runs.md). Workers cannot set it: the agent reads it.
- ``--max-restarts=3``. torchrun's default is 0: a worker that fails, or an agent that
  leaves, ends the job, so ``sw.Resumable`` never gets to resume. Three restarts are the
  docs' example; ``Resumable``'s failure notes say when restarting cannot help.
- ``--rdzv-backend=c10d`` when ``--nnodes`` is a range (``1:2``): the default static
  rendezvous has a fixed membership, so a range needs a dynamic one.

What cannot be chosen here is which agent hosts the c10d rendezvous (``is_host``): torch
makes every agent whose machine the endpoint names try to host, and on one machine the
first to start wins; when that agent dies the job ends. The launcher says so when it
applies and leaves ``--rdzv-conf`` to the user.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from collections.abc import Mapping
from typing import Any

_UNSET: Any = object()
_FRESH_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_RESTARTS = 3
# Options of ours, taken out before torchrun's parser sees the command line.
_DRY_RUN = "--dry-run"


def plan(argv: list[str], environ: dict[str, str] | None = None
         ) -> tuple[list[str], dict[str, str], list[str]]:
    """What ``shardwise run argv`` launches: torchrun's arguments, the environment
    variables to set, and one line per setting chosen here (Note [launcher defaults]).

    Raises:
        SystemExit: a usage error (torchrun's parser, named ``shardwise run``).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    parser = _parser()
    explicit = parser.parse_args(argv)
    given = {dest for dest in ("max_restarts", "rdzv_backend", "rdzv_conf", "rdzv_endpoint",
                               "standalone", "nnodes")
             if getattr(explicit, dest) is not _UNSET
             or f"PET_{dest.upper()}" in env}
    extra: list[str] = []
    set_env: dict[str, str] = {}
    said: list[str] = []
    if _FRESH_STORE in env:
        said.append(f"{_FRESH_STORE}={env[_FRESH_STORE]} (yours, kept)")
    else:
        set_env[_FRESH_STORE] = "1"
        said.append(f"{_FRESH_STORE}=1: every rendezvous round publishes a fresh store, "
                    f"so agents can leave and join (set it to 0 to keep torch's default)")
    if "max_restarts" in given:
        said.append(f"--max-restarts={_value(parser, argv, env, 'max_restarts')} (yours, "
                    f"kept)")
    else:
        extra.append(f"--max-restarts={_RESTARTS}")
        said.append(f"--max-restarts={_RESTARTS}: a failed worker or a lost agent restarts "
                    f"the workers, and sw.Resumable resumes from its last checkpoint "
                    f"(--max-restarts=0 ends the job at the first failure, as torchrun "
                    f"does)")
    nnodes = _value(parser, argv, env, "nnodes")
    elastic = ":" in str(nnodes) and len(set(str(nnodes).split(":"))) > 1
    if elastic and "rdzv_backend" not in given and "standalone" not in given:
        extra.append("--rdzv-backend=c10d")
        said.append(f"--rdzv-backend=c10d: --nnodes={nnodes} is a range, which torchrun's "
                    f"default static rendezvous cannot grow or shrink")
    hosting = _hosting_note(parser, argv, env, given, elastic)
    if hosting:
        said.append(hosting)
    return extra + argv, set_env, said


def main(argv: list[str]) -> int:
    """Run ``shardwise run argv``: say what was set, then launch as torchrun does.

    Returns:
        0 when every worker succeeded, 1 when the job failed (torchrun's report is on
        stderr), 2 for a usage error.
    """
    dry = _DRY_RUN in argv[:_script_index(argv)]
    if dry:
        argv = [a for i, a in enumerate(argv) if not (a == _DRY_RUN and
                                                      i < _script_index(argv))]
    try:
        args, set_env, said = plan(argv)
    except SystemExit as e:
        return int(e.code or 0)
    for line in said:
        print(f"shardwise run: {line}", file=sys.stderr)
    shown = " ".join(f"{k}={v}" for k, v in set_env.items())
    print(f"shardwise run: {shown + ' ' if shown else ''}torchrun "
          f"{' '.join(shlex.quote(a) for a in args)}", file=sys.stderr, flush=True)
    if dry:
        return 0
    os.environ.update(set_env)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(args)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)  # which workers failed, and how
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    """torchrun's own parser, named ``shardwise run``, whose defaults are ``_UNSET`` for
    the options this launcher may set (to tell a default from a value given)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "shardwise run"
    parser.description = ("torchrun with the settings restarts and elastic membership "
                          "need (docs/long-runs.md); options as torchrun's, plus "
                          f"{_DRY_RUN} (print what would run)")
    for action in parser._actions:
        if action.dest in ("max_restarts", "rdzv_backend", "rdzv_conf", "rdzv_endpoint",
                           "standalone", "nnodes"):
            action.default = _UNSET
    return parser


def _value(parser: argparse.ArgumentParser, argv: list[str], env: Mapping[str, str],
           dest: str) -> Any:
    """The value torchrun will use for ``dest``: given, from ``PET_*``, or its default."""
    got = getattr(parser.parse_args(argv), dest)
    if got is not _UNSET:
        return got
    if f"PET_{dest.upper()}" in env:
        return env[f"PET_{dest.upper()}"]
    from torch.distributed.run import get_args_parser

    return get_args_parser().get_default(dest)


def _hosting_note(parser: argparse.ArgumentParser, argv: list[str], env: Mapping[str, str],
                  given: set[str], elastic: bool) -> str | None:
    """A line about ``is_host`` when agents may meet at an endpoint on this machine
    without saying which one hosts the rendezvous (Note [launcher defaults])."""
    if "standalone" in given or "rdzv_endpoint" not in given:
        return None
    backend = ("c10d" if elastic and "rdzv_backend" not in given
               else _value(parser, argv, env, "rdzv_backend"))
    if backend != "c10d":
        return None
    conf = str(_value(parser, argv, env, "rdzv_conf") or "")
    if "is_host=" in conf.replace(" ", ""):
        return None
    host = str(_value(parser, argv, env, "rdzv_endpoint")).rsplit(":", 1)[0]
    if not _names_this_machine(host):
        return None
    return (f"is_host: not given, and the endpoint {host!r} names this machine, so this "
            f"agent hosts the rendezvous if it is the first here to start; the job ends "
            f"if the host's agent dies. With several agents on one machine, pass "
            f"--rdzv-conf=is_host=1 to the one that should host and is_host=0 to the "
            f"others")


def _names_this_machine(host: str) -> bool:
    if host in ("", "localhost", "127.0.0.1", "::1", socket.gethostname(),
                socket.getfqdn()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def _script_index(argv: list[str]) -> int:
    """Where the script starts in ``argv`` (best effort, for our own options only): the
    first word that is not an option or an option's value."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-"):
            return i
        i += 1 if "=" in word or word in _FLAGS else 2
    return len(argv)


# torchrun's options that take no value (the others take one, as --opt VALUE or =VALUE).
_FLAGS = {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path",
          "--run_path", "--virtual-local-rank", "--virtual_local_rank", _DRY_RUN,
          "-h", "--help"}
