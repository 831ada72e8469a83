"""Paths confined to a folder: a model repository's files must resolve inside it, however they are
reached (a manifest's names, a symlink). Standard library only: the repository, the engine's loader and
the gateway all check with it."""

import os
from pathlib import Path


class RepositoryError(ValueError):
    """A bad name, path or version; the admin API answers these with 400."""


def joined(folder: Path, *parts: str) -> Path:
    """``folder/parts...`` when no part is empty, absolute, ``..`` or a Windows path; not yet resolved."""
    for part in parts:
        if not part or os.path.isabs(part) or any(p in ("..", "") for p in Path(part).parts) or "\\" in part:
            raise RepositoryError(f"path component {part!r} is not allowed")
    return folder.joinpath(*parts)


def inside(root: Path, path: Path, what: str) -> Path:
    """``path`` with every symlink resolved, or RepositoryError naming ``what`` if that is not in ``root``.
    Open the returned path, not ``path``: a link swapped after this check is then not followed."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(root)):
        raise RepositoryError(f"{what} resolves outside the model repository")
    return real
