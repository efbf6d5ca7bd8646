"""The ``dijax`` command line: ``main`` (dijax.cli.main) and one module per subcommand."""

from __future__ import annotations

USER_ERRORS = (OSError, ValueError, TypeError)
"""What a user's input can cause (a bad path, file, config, fixture or option): one line on stderr, exit 2."""


def describe_error(error: BaseException) -> str:
    """One line for a user error. OSErrors name their path (``strerror: path``), whatever raised them."""
    if isinstance(error, OSError) and error.strerror:
        paths = [p for p in (error.filename, error.filename2) if p is not None]
        text = f"{error.strerror}: {' -> '.join(str(p) for p in paths)}" if paths else error.strerror
    else:
        text = str(error)
    return " ".join(text.split()) or type(error).__name__
