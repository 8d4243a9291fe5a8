"""Error types whose messages are one line: what, where, what to do.

Every user-facing failure in hyfi-imaging is raised as a :class:`HyfiError`
(or a subclass) built with :func:`problem`, so that command-line tools can print
``str(err)`` as the single line a user reads, and manifests can store it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "HyfiError", "SlideError", "problem"]


def problem(where: object, what: str, fix: str) -> str:
    """Format the one-line message ``"<where>: <what>; <fix>"``."""
    where = str(where).replace("\n", " ")
    fix = fix.rstrip(".")
    return f"{where}: {what.rstrip('.')}; {fix}{'' if fix.endswith(('?', '!')) else '.'}"


class HyfiError(Exception):
    """Base of all hyfi-imaging errors; ``str(err)`` is one line for the user.

    ``collective`` says the error is raised alike on every rank of a job (it
    follows from the configuration or from a decision the ranks agreed on), so
    a launcher prints it once, from rank 0; otherwise every rank that raises it
    prints it, naming itself.
    """

    collective: bool = False

    def __init__(self, where: object, what: str, fix: str) -> None:
        self.where = str(where)
        self.what = what
        self.fix = fix
        super().__init__(problem(where, what, fix))


class SlideError(HyfiError):
    """A slide or image file cannot be opened, read or used."""


class ConfigError(HyfiError, ValueError):
    """A command-line option, layout or configuration value is invalid.

    Also a ValueError, so that argparse ``type=`` converters raising it produce a
    usage error (exit 2) instead of a traceback. Collective: every rank reads
    the same configuration.
    """

    collective = True
