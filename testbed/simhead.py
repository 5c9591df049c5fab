"""The head's side of the simulated cluster: `dtrain launch` itself, over a transport whose
hosts are agents in `testbed.simcluster` processes, with every frame counted at the head.

    python -m testbed.simhead --ports 40001,40002 --stats head.json -- \\
        -H sim1:8,sim2:8,... -- /bin/true

runs the real CLI (`launcher.cli.main`, ``launch`` with ``--launcher sim``): the same hosts,
plan, supervisor, PMI relay, output and report as any launch. The only difference is the
table row the launch finds its agents through (`transport.table` is the one place a launch
asks; this process adds rows to it, nothing else of the launcher changes):

    sim          host i is a TCP connection on loopback to the i-th simcluster port (round
                 robin), its first line the host's name; the agent there is the real one;
                 with --fanout, relays dial their hosts' ports the same way
    counted      the ssh launcher's own rows (local subprocess, paramiko, openssh), each
                 stream counted the same way (real agents, for the fidelity comparison)
    counted-local  every host a local agent subprocess whatever its name (real agents on
                 this machine under distinct host names)
    rendezvous   (replaced) the real join flow, its agents' streams counted

At the end ``--stats`` gets JSON: frames and bytes per direction and kind (PMI frames per
``op``), the head's CPU seconds and peak RSS, and when the launch began and returned
(CLOCK_MONOTONIC, shared with the simcluster processes' stamps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import struct
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

from launcher import wire

#: The simcluster ports, set by `main` (module state: the table's entry takes no extra args).
PORTS: list[int] = []
#: Every counted stream's counter, merged at the end.
COUNTERS: list[FrameCounter] = []
#: When each DONE frame came off a stream at the head (CLOCK_MONOTONIC): the exit tail's
#: split between the agents reporting and the head's loop seeing their reports.
DONE_AT: list[float] = []


class FrameCounter:
    """Frames and bytes per (direction, kind) on one stream; PMI frames by their ``op``.

    It reads frame headers and first bytes (a PMI frame's ``op``, inflated when compressed),
    never copies or decodes a payload but a ROUTED frame's (its hosts' small frames, each
    counted under its own kind too): it runs in the head's process, whose CPU is measured."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self._scan = {"out": _Scanner(), "in": _Scanner()}

    def feed(self, direction: str, data: bytes, scanner: _Scanner | None = None) -> None:
        for kind, size, peek in (scanner or self._scan[direction]).feed(data):
            name = wire.Kind(kind).name
            if kind == wire.Kind.ROUTED:  # peek: the whole payload (`_Scanner`)
                self.feed(direction, peek[_INDEX_BYTES:], _Scanner())
            if kind == wire.Kind.DONE:  # when the head's reader got it (the tail's split)
                DONE_AT.append(time.monotonic())
            if kind == wire.Kind.PMI:  # a compressed one (launcher.wire.COMPRESSED) inflated
                head = zlib.decompressobj().decompress(peek, 64) if peek[:1] == b"x" else peek
                found = _OP.search(head)
                name = f"PMI:{found.group(1).decode() if found else '?'}"
            self.counts[direction, name] += 1
            self.bytes[direction, name] += size


_OP = re.compile(rb'"op":\s*"([A-Za-z_]+)"')
_HEADER = struct.Struct("!IB")  # launcher.wire's: length (kind + payload), kind
_PEEK = 1024  # enough of a compressed PMI frame to inflate where its op is
_INDEX_BYTES = 4  # a ROUTED frame's host index (launcher.wire)


class _Scanner:
    """Whole frames' (kind, size, first payload bytes: all of a ROUTED frame's) from a stream
    fed in any pieces."""

    def __init__(self) -> None:
        self._header = b""
        self._left = 0      # payload bytes of the current frame still to come
        self._kind = self._size = 0
        self._want = _PEEK  # payload bytes to keep: a PMI frame's op, a ROUTED frame's all
        self._peek = b""

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        done: list[tuple[int, int, bytes]] = []
        at, end = 0, len(data)
        while at < end:
            if not self._left:
                take = min(_HEADER.size - len(self._header), end - at)
                self._header += data[at:at + take]
                at += take
                if len(self._header) < _HEADER.size:
                    break
                length, self._kind = _HEADER.unpack(self._header)
                self._header, self._size, self._left, self._peek = b"", 4 + length, length - 1, b""
                self._want = length if self._kind == wire.Kind.ROUTED else _PEEK
                if not self._left:
                    done.append((self._kind, self._size, b""))
                    continue
            take = min(self._left, end - at)
            if len(self._peek) < self._want:
                self._peek += data[at:at + min(take, self._want - len(self._peek))]
            at += take
            self._left -= take
            if not self._left:
                done.append((self._kind, self._size, self._peek))
        return done


def totals() -> dict[str, dict[str, list[int]]]:
    """{"out"|"in": {kind: [frames, bytes]}} over every counted stream."""
    counts: Counter[tuple[str, str]] = Counter()
    sizes: Counter[tuple[str, str]] = Counter()
    for counter in COUNTERS:
        counts.update(counter.counts)
        sizes.update(counter.bytes)
    out: dict[str, dict[str, list[int]]] = {"out": {}, "in": {}}
    for (direction, kind), n in sorted(counts.items()):
        out[direction][kind] = [n, sizes[direction, kind]]
    return out


class CountingStream:
    """An AgentStream that counts what passes through it, in both directions."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.counter = FrameCounter()
        COUNTERS.append(self.counter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, data: bytes) -> None:
        self.counter.feed("out", data)
        self._inner.write(data)

    def read(self, max_bytes: int = 65536) -> bytes:
        data: bytes = self._inner.read(max_bytes)
        self.counter.feed("in", data)
        return data

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        """The inner stream's (`launcher.transport.pump`, which asks for it only when the inner
        stream has a `reader_fd`), counted."""
        data: bytes | None = self._inner.read_ready(max_bytes)
        if data:
            self.counter.feed("in", data)
        return data


class _Loopback:
    """The AgentConnection of a simulated host: reached at 127.0.0.1."""

    latency_ms = 0.0

    def peer_address(self) -> str:
        return "127.0.0.1"

    def close(self) -> None:
        pass


class SimAgentStream:
    """A TCP connection to a simcluster process, which runs this host's agent."""

    is_local = False

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.connection = _Loopback()
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(f"{host}\n".encode())
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._closed = self._aborted = False

    def write(self, data: bytes) -> None:
        self._sock.sendall(data)

    def read(self, max_bytes: int = 65536) -> bytes:
        if self._aborted:
            return b""
        try:
            data = self._sock.recv(max_bytes)
        except OSError:
            data = b""
        if not data:
            self._ended.set()
        return data

    def reader_fd(self) -> int:
        return self._sock.fileno()

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        if self._aborted:
            return b""
        try:
            data = self._sock.recv(max_bytes, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            self._ended.set()
        return data

    def close(self) -> None:
        """EOF to the agent, as closing an SSH channel's stdin: it stops its ranks."""
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    self._sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def abort(self) -> None:
        self._aborted = True
        self.close()

    def wait(self, timeout: float | None = None) -> int | None:
        """0 once the agent closed its end (its process, here a thread, has left)."""
        return 0 if self._ended.wait(timeout) else None

    def kill(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._ended.set()

    def stderr_text(self) -> str:
        return ""

    def transport_error(self) -> None:
        return None


def port_for(name: str) -> int:
    """The simcluster port of host ``name``: sim<i> on port i-1 mod len(PORTS) (round robin
    in host order), other names by a checksum."""
    if not PORTS:
        raise RuntimeError("no simcluster ports: run through testbed.simhead.main")
    digits = name[3:] if name.startswith("sim") else ""
    number = int(digits) - 1 if digits.isdigit() else zlib.crc32(name.encode())
    return PORTS[number % len(PORTS)]


def start_sim(selected: Sequence[Any], *, python: str, ssh: Any,
              opened: Any = None) -> list[Any]:
    """The `sim` row: each host on its simcluster port (`port_for`), every stream counted,
    each told to ``opened`` as it connects (`launcher.head.early`)."""
    PHASES.setdefault("connect", time.monotonic())
    streams = []
    for index, h in enumerate(selected):
        streams.append(CountingStream(SimAgentStream(h.entry.name, port_for(h.entry.name))))
        if opened is not None:
            opened(index, streams[-1])
    PHASES["connected"] = time.monotonic()
    return streams


def describe_sim(entries: Sequence[Any], ssh: Any) -> list[dict[str, Any]]:
    """The `sim` row's relays: the hop to each host below a relay is its simcluster port
    (`testbed.simcluster.connect_child` dials it)."""
    return [{"hostname": "127.0.0.1", "port": port_for(e.name)} for e in entries]


def start_counted(selected: Sequence[Any], *, python: str, ssh: Any,
                  opened: Any = None) -> list[Any]:
    """The `counted` row: the ssh launcher's own streams (real agents), counted (what goes
    as each opens too: ``opened`` hears the counted stream)."""
    from launcher.transport.connect import start_by_host

    counted: dict[int, CountingStream] = {}
    lock = threading.Lock()

    def count(index: int, stream: Any) -> CountingStream:
        with lock:
            return counted.setdefault(index, CountingStream(stream))

    def told(index: int, stream: Any) -> None:
        if opened is not None:
            opened(index, count(index, stream))

    results = start_by_host(selected, python=python, ssh=ssh, opened=told)
    return [r if isinstance(r, Exception) else count(i, r) for i, r in enumerate(results)]


def start_counted_local(selected: Sequence[Any], *, python: str, ssh: Any,
                        opened: Any = None) -> list[Any]:
    """The `counted-local` row: a real local agent subprocess per host, whatever its name."""
    from launcher.transport.local import LocalAgentStream

    streams = []
    for index, h in enumerate(selected):
        streams.append(CountingStream(LocalAgentStream(h.entry.name, python=python)))
        if opened is not None:
            opened(index, streams[-1])
    return streams


#: When the rendezvous head had every agent joined (CLOCK_MONOTONIC), for `--stats`.
JOINED_AT: list[float] = []
#: Where the head's time went (CLOCK_MONOTONIC per step, `--stats`' ``phases``): its start
#: (the `sim` row's connections, the links adopted, the SPECs sent and every READY back: an
#: agent hears nothing from the head until its SPEC) and its end: when the supervisor's loop
#: saw every host done, the agents dismissed, the streams closed, the report printed; the exit
#: tail is these steps after the last rank's exit.
PHASES: dict[str, float] = {}


def _stamped(owner: Any, name: str, begin: str, end: str) -> None:
    """Wrap ``owner.name`` so that its call's start and end are stamped in `PHASES` (the
    first call's start, the last call's end)."""
    inner = getattr(owner, name)

    def stamped(*args: Any, **kw: Any) -> Any:
        PHASES.setdefault(begin, time.monotonic())
        try:
            return inner(*args, **kw)
        finally:
            PHASES[end] = time.monotonic()

    setattr(owner, name, stamped)


def trace_phases() -> None:
    """Stamp the head's start-up and end-of-job steps (`PHASES`): the links adopted, the
    SPECs out and READYs back, the supervisor's loop, dismissing the agents, closing their
    streams, the report. Each module is patched as it is imported, where the launch imports
    it (the supervisor's while the agents boot), not before."""
    from launcher import launch

    _stamped(launch, "close_streams", "close", "closed")
    _stamped(launch, "_print_end", "report", "reported")
    sys.meta_path.insert(0, _AfterImport({
        "launcher.restart.rounds": lambda m: _stamped(m.Rounds, "adopt", "adopt", "adopted"),
        "launcher.head.startup": lambda m: _stamped(m.Startup, "prepare", "prepare",
                                                    "prepared"),
        "launcher.head.supervisor": lambda m: _stamped(m.Supervisor, "_loop", "loop", "loop_end"),
        "launcher.head.agent_link": lambda m: _stamped(m.Fleet, "dismiss", "dismiss",
                                                       "dismissed")}))


class _AfterImport:
    """A meta path finder that runs ``patches[name](module)`` once module ``name`` is made."""

    def __init__(self, patches: dict[str, Any]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        import importlib.util

        spec = importlib.util.find_spec(name)  # the other finders' (ours has none for it now)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader

        class Loader:
            def create_module(self, spec: Any) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: Any) -> None:
                inner.exec_module(module)
                patch(module)

        spec.loader = Loader()
        return spec


def join_counted(opts: Any, **kw: Any) -> Any:
    """The `rendezvous` row, its joined agents' streams counted: the head's real listener,
    handshakes and roster (`launcher.rendezvous.head.join_agents`)."""
    import dataclasses

    from launcher.rendezvous.head import join_agents

    joined = join_agents(opts, **kw)
    JOINED_AT.append(time.monotonic())
    return dataclasses.replace(joined, streams=[CountingStream(s) for s in joined.streams])


def install() -> None:
    """Add the rows to the transport table (before the CLI builds its --launcher choices)."""
    import dataclasses

    from launcher.transport import table

    rows = [table.Transport(name, table.Flow.DISPATCH, summary, f"testbed.simhead:{entry}",
                            relays=relays)
            for name, summary, entry, relays in (
                ("sim", "agents of simulated hosts (testbed.simcluster)", "start_sim",
                 "testbed.simhead:describe_sim"),
                ("counted", "the ssh launcher, frames counted", "start_counted", ""),
                ("counted-local", "local agents under any name, frames counted",
                 "start_counted_local", ""))]
    known = {t.name for t in table.TRANSPORTS}
    table.TRANSPORTS = (*(dataclasses.replace(t, entry="testbed.simhead:join_counted")
                          if t.flow is table.Flow.JOIN else t for t in table.TRANSPORTS),
                        *(r for r in rows if r.name not in known))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.simhead")
    ap.add_argument("--ports", default="", help="simcluster ports, comma-separated")
    ap.add_argument("--stats", required=True, help="where to write the head's counts")
    ap.add_argument("--launcher", default="sim", help="sim, counted or counted-local")
    ap.add_argument("launch", nargs=argparse.REMAINDER, help="`dtrain launch` arguments")
    args = ap.parse_args(argv)
    PORTS[:] = [int(p) for p in args.ports.split(",") if p]
    launch_args = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    began = time.monotonic()
    install()
    if os.environ.get("DTRAIN_SIM_PHASES"):
        trace_phases()
    from launcher import cli as cli_module
    from launcher.cli import main as cli

    # The real head ends with os._exit once the job is over (`launcher.cli._leave`); this one
    # returns here, to write its stats, and ends as the ordinary exit would.
    cli_module._leave = sys.exit
    code: int | str | None = 0
    try:
        cli.main(["launch", "--launcher", args.launcher, *launch_args], prog_name="dtrain")
    except SystemExit as exc:
        code = exc.code
    returned = time.monotonic()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(args.stats, "w") as out:
        json.dump({"frames": totals(), "began": began, "returned": returned,
                   "joined": JOINED_AT[0] if JOINED_AT else None, "phases": PHASES,
                   "last_done": max(DONE_AT, default=None),
                   "cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kib": usage.ru_maxrss,
                   "code": code}, out)
    return code if isinstance(code, int) else 1


if __name__ == "__main__":  # the module's state lives in testbed.simhead, not in __main__
    from testbed import simhead

    sys.exit(simhead.main())
