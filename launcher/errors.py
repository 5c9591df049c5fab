"""The launcher's exceptions: one hierarchy, one message shape.

Every message reads ``<what failed> [<where>]: <why>. <how to fix>`` so a user can act on it
without reading code; ``where`` is a ``path:line``, a host, a rank or an option.
"""

from __future__ import annotations

# The base is shared with the trainer (one message shape), re-exported for the launcher.
from workerenv import DtrainError as DtrainError

TYPE_CHECKING = False  # `typing` is not worth its import to every launch; mypy reads True
if TYPE_CHECKING:
    from collections.abc import Sequence


def listed(names: Sequence[str], most: int) -> str:
    """``a, b, c``, or past ``most`` names ``a, b and 7 more``: a message naming hosts or
    addresses stays one line at any number of them."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class UsageError(DtrainError):
    """A command-line option or combination of options is wrong."""


class HostfileError(DtrainError):
    """The hostfile or an inline host list cannot be used; raised before any connection."""


class EnvironmentFileError(DtrainError):
    """A .dtrainenv file or an --env value is malformed."""


class ConnectError(DtrainError):
    """A host could not be reached, authenticated or verified; nothing was started."""

    exit_code = 255


class UnreachableError(ConnectError):
    """A host does not resolve or accept connections (yet): a launch tries it again until
    --launch-timeout (a Kubernetes worker whose pod or DNS record is not up yet)."""


class HostKeyError(ConnectError):
    """A host key is unknown (and --ssh-accept-new was not given) or has changed."""


class AgentError(DtrainError):
    """The per-host agent could not start, speaks another version, or broke the protocol."""

    exit_code = 255


class PmiError(DtrainError):
    """A PMI-1 client sent something the server refuses."""


class RendezvousError(DtrainError):
    """Agents and the head did not meet: a wrong token, a refused agent, a rendezvous timeout."""

    exit_code = 255
