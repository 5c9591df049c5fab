"""The sealed byte stream of a rendezvous connection, once the handshake is done.

Everything after the handshake (JOIN, the SPEC with the ranks' environment, PMI, output) goes
in records: ``length (u32) | ChaCha20-Poly1305(data)``, one key per direction from the
handshake, the record's number as its nonce and its length header as associated data. So
nothing travels in clear (a forwarded API key in the SPEC stays private on a shared network),
and a record changed, dropped, replayed or reordered fails to open: the stream is then broken,
as any other broken stream to an agent. The cipher is `cryptography`'s (paramiko's own
dependency); no cryptography is written here.

Pure: bytes in, bytes out (the adapters own the sockets).
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from launcher.wire import WireError

RECORD_MAX = 1 << 20            # plaintext bytes per record; a bigger write is split
_TAG = 16                       # Poly1305 tag bytes
_HEADER = struct.Struct("!I")


class ChannelError(WireError):
    """A record did not open: tampered with, out of order, or not a record at all."""


class Channel:
    """Seal what one side sends, open what it receives (each direction used by one thread)."""

    def __init__(self, *, send_key: bytes, receive_key: bytes) -> None:
        self._sealer, self._opener = ChaCha20Poly1305(send_key), ChaCha20Poly1305(receive_key)
        self._sent = self._opened = 0
        self._pending = bytearray()

    def seal(self, data: bytes) -> bytes:
        """``data`` as one record, or several when it is over RECORD_MAX bytes."""
        out = bytearray()
        view = memoryview(data)
        while True:
            chunk, view = view[:RECORD_MAX], view[RECORD_MAX:]
            header = _HEADER.pack(len(chunk) + _TAG)
            out += header + self._sealer.encrypt(self._nonce(self._sent), bytes(chunk), header)
            self._sent += 1
            if not view:
                return bytes(out)

    def open(self, data: bytes) -> bytes:
        """The plaintext of every record ``data`` completes (b"" while one is still partial)."""
        self._pending += data
        plain = bytearray()
        while len(self._pending) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._pending)
            if not _TAG <= length <= RECORD_MAX + _TAG:
                raise ChannelError(f"record length {length} out of range")
            if len(self._pending) < _HEADER.size + length:
                break
            header = bytes(self._pending[:_HEADER.size])
            sealed = bytes(self._pending[_HEADER.size:_HEADER.size + length])
            try:
                plain += self._opener.decrypt(self._nonce(self._opened), sealed, header)
            except InvalidTag:
                raise ChannelError(f"record {self._opened} does not open: changed, dropped or "
                                   "replayed on the way, or sealed with another key") from None
            self._opened += 1
            del self._pending[:_HEADER.size + length]
        return bytes(plain)

    @staticmethod
    def _nonce(number: int) -> bytes:
        return number.to_bytes(12, "big")
