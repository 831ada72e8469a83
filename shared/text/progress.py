"""Progress bars, one display per process, labelled with the process's role. ``kvrelay serve``'s workers
share one terminal: unlabelled, their "Loading weights" bars wrote over each other on one line and said
nothing of whose they were. A worker names itself once (``label_process``); every bar it draws then says
the role and, on a terminal, keeps the role's own line."""

import sys

from tqdm.auto import tqdm

_label = ""
_line = 0


def label_process(label: str, line: int = 0) -> None:
    """``label`` prefixes every bar of this process; ``line``: which terminal line below the cursor its bars
    use, so processes sharing a terminal each keep one (kvrelay serve: prefill 0, decode 1)."""
    global _label, _line
    _label, _line = label, line


def progress_bar(desc: str, **kwargs) -> tqdm:
    kwargs.setdefault("file", sys.stderr)
    if _line and kwargs["file"].isatty():  # cursor moves only where a terminal reads them, not into logs
        kwargs.setdefault("position", _line)
    return tqdm(desc=f"{_label}: {desc}" if _label else desc, **kwargs)
