"""A relay's children's streams, read and sent up (`launcher.tree.relay` owns the rest).

One thread reads every child's stream that can be polled (`launcher.transport.pump`), a thread
each the others. A read's frames go up in order: a child's own frames wrapped (ROUTED with its
index, one frame per run of them), a child relay's ROUTED and GONE frames as they are, its rank
output under the writer's back-pressure; a PMI message the relay takes (the fence's
``barrier_in``, a ``get`` for a card it holds, a ``fetch``) does not go up.

What a read sends up is written by the reading thread itself while nothing else waits for the
parent's stream (`HeadLink.forward`): not handed to the agent's writer thread, whose wake-up was
one of the three thread hand-offs a frame took at each relay on its way up. That write may wait
for the parent to read, which holds up every child's stream here, as rank output does: their
frames wait in their transports' buffers.
"""

from __future__ import annotations

import threading

from launcher import wire

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol

    from launcher.transport.stream import AgentStream

    class Upward(Protocol):
        """The link to the relay's parent (the agent's `HeadLink`)."""

        def forward(self, data: bytes) -> bool: ...
        def send_output_frame(self, frame: bytes) -> bool: ...


class Upstream:
    def __init__(self, up: Upward, take_pmi: Callable[[int, memoryview], bool],
                 ended: Callable[[int, AgentStream, BaseException | None], None]) -> None:
        """``take_pmi(child, payload)``: True when the relay took a child's PMI message (it is
        not to go up; ``payload``, a view into the frame, is not kept); ``ended(child, stream,
        error)``: a child's stream ended (None: closed)."""
        from launcher.transport.pump import ReadPump

        self.up, self._take_pmi, self._ended = up, take_pmi, ended
        self.spoke: set[int] = set()  # children whose agent sent its first frame
        self._pump: Any = ReadPump()  # given streams with a descriptor (`read`)

    def read(self, index: int, stream: AgentStream) -> None:
        """Read child ``index``'s stream from now on, to its end."""
        if hasattr(stream, "reader_fd"):  # chosen once: the pump reads every such child
            decoder = wire.Decoder()
            self._pump.add(stream, lambda data: self.received(index, decoder, data),
                           lambda error: self._ended(index, stream, error))
        else:
            threading.Thread(target=self._read, args=(index, stream), name=f"relay-{index}",
                             daemon=True).start()

    def _read(self, index: int, stream: AgentStream) -> None:  # a stream the pump cannot poll
        decoder, error = wire.Decoder(), None
        try:
            while data := stream.read(65536):
                self.received(index, decoder, data)
        except (OSError, EOFError, ValueError) as exc:
            error = exc
        self._ended(index, stream, error)

    def received(self, index: int, decoder: wire.Decoder, data: bytes) -> None:
        """One read of child ``index``'s stream: its frames up, in one write where they can
        be, or taken here."""
        self.spoke.add(index)
        out: list[bytes] = []  # frames for the parent, in order
        own: list[bytes] = []  # the child's own frames not yet wrapped
        for frame in decoder.feed_raw(data):  # each as it came: forwarded, not encoded again
            kind = frame[4]
            if kind in (wire.Kind.ROUTED, wire.Kind.GONE):
                _wrap(index, own, out)
                out.append(frame)
            elif kind == wire.Kind.OUTPUT:
                _wrap(index, own, out)
                self._forward(out)
                self.up.send_output_frame(wire.encode_routed(index, frame))
            elif kind == wire.Kind.PMI:
                _wrap(index, own, out)
                self._forward(out)  # what came before goes first: what it sends may go up
                if not self._take_pmi(index, memoryview(frame)[5:]):  # its payload, not a copy
                    own.append(frame)
            else:
                own.append(frame)
        _wrap(index, own, out)
        self._forward(out)

    def _forward(self, out: list[bytes]) -> None:
        if out:
            self.up.forward(b"".join(out))
            out.clear()


def _wrap(index: int, own: list[bytes], out: list[bytes]) -> None:
    """A child's own frames so far, as one ROUTED frame for ``out``."""
    if own:
        out.append(wire.encode_routed(index, b"".join(own)))
        own.clear()
