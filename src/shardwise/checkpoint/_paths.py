"""Paths a checkpoint is given or names: arguments checked, names kept inside their folder."""

from __future__ import annotations

import os

from ..errors import ShardwiseError


def path_argument(path: object, function: str) -> str:
    """``path`` as a string, or a ShardwiseError saying what ``function`` takes."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ShardwiseError(f"{function}: path must be a non-empty str or os.PathLike "
                             f"(a folder), got {path!r:.80}")
    return path


def inside(folder: str, relative: object, what: str) -> str:
    """``folder/relative``, refused unless it stays inside ``folder`` once every symlink
    is resolved (a metadata file must never make a load read from elsewhere).

    Raises:
        ShardwiseError: naming ``what`` (the file and field) and the path.
    """
    if not isinstance(relative, str) or not relative or os.path.isabs(relative):
        raise ShardwiseError(f"{what}: {relative!r} is not a path relative to {folder}")
    root = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(folder, relative))
    if os.path.commonpath([root, target]) != root:
        raise ShardwiseError(f"{what}: {relative!r} leads outside {folder} (to {target})")
    return os.path.join(folder, relative)
