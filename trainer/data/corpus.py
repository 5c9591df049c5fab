"""Byte-level language-model data: a corpus every host has (its batches: `trainer.data.batches`).

Corpus. By default the Python standard library's own source files (``sysconfig`` "stdlib"
path): present on every host without a download, sorted by relative path and concatenated, so
every rank that runs the same Python reads the same bytes. ``--data PATH`` names a text file or
a folder (every regular file under it, sorted; anything else, a FIFO, a device, a link to a
folder, is never opened but listed in ``Corpus.skipped`` for a warning). The corpus is capped
(``cap_bytes``) so start-up stays fast: no file is read past what the cap (plus the validation
tail) still takes, so a huge file costs no more memory than the cap; ``Corpus.fingerprint``
lets the ranks check that they all read the same bytes. Files that look binary (a NUL byte, or
not UTF-8) are still read, and listed in ``Corpus.binary_files`` so the trainer can warn;
`check_vocab` refuses a vocabulary that cannot hold every byte of the data, naming the first
byte that does not fit by file and line.

Validation split. The last ``val_fraction`` of the bytes read (the end of the last files) is
held out: training windows are drawn from ``Corpus.train`` only, validation windows from
``Corpus.val`` only, so no validation byte is ever trained on (windows never straddle the cut).
The cap is the training split's: reading goes on past it by ``val_fraction / (1 -
val_fraction)`` of it, so a corpus larger than that trains on exactly the bytes it would
without a validation split; a smaller one is split val_fraction : 1 - val_fraction.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from trainer.errors import TrainerError

DEFAULT_CAP_BYTES = 8 * 1024 * 1024
DEFAULT_VAL_FRACTION = 0.05
_SEPARATOR = b"\n\n"


class DataError(TrainerError):
    """The corpus cannot be read or is too small for the sequence length."""


@dataclass(frozen=True)
class Corpus:
    """The data's bytes, as a uint8 tensor, plus where they came from and where the held-out
    validation tail starts."""

    tokens: torch.Tensor
    source: str
    unit: ClassVar[str] = "bytes"
    """What one token is (a `trainer.data.sources.TokenData` says "tokens")."""
    val_bytes: int = 0
    """The last ``val_bytes`` bytes are the validation split."""
    files: tuple[tuple[int, str], ...] = ()
    """(offset of its first byte, path) of every file read, in order."""
    binary_files: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    """"path (why)" of every entry that was not read: not a regular file, or unreadable."""

    @property
    def train(self) -> torch.Tensor:
        return self.tokens[:len(self) - self.val_bytes]

    @property
    def val(self) -> torch.Tensor:
        return self.tokens[len(self) - self.val_bytes:]

    def locate(self, offset: int) -> str:
        """``path:line`` of the byte at ``offset``."""
        start, path = max((f for f in self.files if f[0] <= offset), default=(0, self.source))
        line = int((self.tokens[start:offset] == ord("\n")).sum()) + 1
        return f"{path}:{line}"

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the bytes (first 16 hex digits): same value on every rank or data differs.
        Computed once (start-up, every save's meta read it: the corpus's bytes never change)."""
        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self.tokens.numel())


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> Iterator[Path]:
    """Files under ``root`` in a host-independent order, lazily (reading stops at the cap).

    Depth first; in each folder its files by name, then its subfolders by name; hidden entries
    (``.git``, ``.DS_Store``) are skipped. For the default stdlib corpus only ``.py`` files count
    and ``site-packages`` is skipped, so what a user installed into the interpreter does not
    change the data."""
    if not root.is_dir():
        yield root
        return
    stdlib = root == stdlib_dir()
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs
                            if d not in ("site-packages", "__pycache__") and d[0] != ".")
        # A link to a folder is not walked into: it goes with the files, to be listed as skipped.
        linked = [d for d in subdirs if os.path.islink(os.path.join(folder, d))]
        for name in sorted(names + linked):
            if name[0] != "." and (not stdlib or name.endswith(".py")):
                yield Path(folder, name)


def read_regular(path: Path, limit: int) -> tuple[bytes | None, str]:
    """Up to ``limit`` bytes of ``path`` if it is a regular file (a link to one counts), else
    None and why it is skipped. The kind is checked before the file is opened (a FIFO would
    block the open, ``/dev/zero`` never ends) and again on the opened descriptor, which is
    opened non-blocking in case the path was swapped in between."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            return None, _not_regular(path, mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        with open(fd, "rb") as fh:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                return None, _not_regular(path, mode)
            return fh.read(limit), ""
    except OSError as exc:
        return None, f"unreadable: {exc.strerror or exc}"


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _not_regular(path: Path, mode: int) -> str:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return f"a link to {os.readlink(path)}, {kind}" if path.is_symlink() else kind


def load_corpus(path: str | None = None, *, cap_bytes: int = DEFAULT_CAP_BYTES,
                val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    """Read up to ``cap_bytes`` of training text from ``path`` (default: the stdlib sources),
    then the validation split after it (module docstring)."""
    root = stdlib_dir() if path is None else Path(path).expanduser()
    if not root.exists():
        raise DataError("data path not found", str(root), "it does not exist",
                        "Pass --data with a text file or folder present on every host")
    if not (root.is_dir() or root.is_file()):
        raise DataError("data path is not a file or a folder", str(root),
                        f"it is {_not_regular(root, os.stat(root).st_mode)}, and only regular "
                        "files are read", "Pass --data with a text file or a folder of them")
    if cap_bytes < 1:
        raise DataError("no training data", f"cap {cap_bytes} bytes", "the cap reads nothing",
                        "Pass a --data-cap-mb above 0")
    val_cap = int(cap_bytes * val_fraction / (1 - val_fraction))
    limit = cap_bytes + val_cap
    data = bytearray()  # what is read, never more than the limit plus a separator
    files: list[tuple[int, str]] = []
    binary: list[str] = []
    skipped: list[str] = []
    for file in corpus_files(root):
        raw, why = read_regular(file, limit - len(data))  # at most what the cap still takes
        if raw is None:
            skipped.append(f"{file} ({why})")  # deterministically: the same on every host
            continue
        if raw:
            files.append((len(data), str(file)))
            binary += [str(file)] if looks_binary(raw, cut=len(data) + len(raw) == limit) \
                else []
        data += raw + _SEPARATOR
        if len(data) >= limit:
            break
    if not files:
        raise DataError("no training data", str(root),
                        ("the folder has no non-empty, readable regular file" if root.is_dir()
                         else "the file is empty")
                        + (f" (skipped: {_listed(skipped)})" if skipped else ""),
                        "Pass --data with a text file or a folder of text files")
    del data[limit:]
    val_bytes = val_cap if len(data) == limit else int(len(data) * val_fraction)
    return Corpus(torch.frombuffer(data, dtype=torch.uint8), str(root),
                  val_bytes=val_bytes, files=tuple(files), binary_files=tuple(binary),
                  skipped=tuple(skipped))


def _listed(items: list[str] | tuple[str, ...], shown: int = 5) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


class Listed(Protocol):
    """What `skipped_warning` reads of a `Corpus` (or of tokenized data, which skips nothing)."""

    @property
    def skipped(self) -> tuple[str, ...]: ...


def skipped_warning(corpus: Listed) -> str:
    """The warning about what ``--data`` held but was not read ("" when nothing was)."""
    if not corpus.skipped:
        return ""
    return (f"warning: not read from the training data [{_listed(corpus.skipped)}]: "
            f"{len(corpus.skipped)} entr{'y is' if len(corpus.skipped) == 1 else 'ies are'} "
            "not regular files (or cannot be read); only regular files are read. Move them out "
            "of --data to silence this")


def looks_binary(raw: bytes, *, cut: bool = False) -> bool:
    """A NUL byte, or bytes that are not UTF-8 (git's NUL test, plus encoding). ``cut``: the
    read stopped at the cap, so a character cut in two at the end is not a fault."""
    if b"\0" in raw:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=not cut)
    except UnicodeDecodeError:
        return True
    return False


def check_vocab(corpus: Corpus, vocab_size: int) -> None:
    """Refuse a vocabulary too small for the data's bytes (a byte is its token id)."""
    high = int(corpus.tokens.max())
    if high < vocab_size:
        return
    first = int((corpus.tokens >= vocab_size).nonzero()[0])
    raise DataError("vocabulary too small for the data",
                    f"--vocab-size {vocab_size}; byte {int(corpus.tokens[first])} at "
                    f"{corpus.locate(first)}",
                    f"token ids are bytes and the data has bytes up to {high}, but ids must be "
                    "below vocab_size", f"Use --vocab-size {max(high + 1, 256)} (256 holds every "
                    "byte), or train on data without those bytes")
