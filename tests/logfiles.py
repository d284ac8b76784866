"""Reading the files of rqp.storage.log in tests: a log file ends in zero bytes after its good
data (space reserved ahead of the appends), so a test compares the bytes up to where the good
data ends and checks that only zeros follow."""

from __future__ import annotations

from pathlib import Path


def written(path: str | Path, size: int) -> bytes:
    """The first ``size`` bytes of the log file at ``path``, after checking that every byte
    after them is zero (reserved space, not data)."""
    data = Path(path).read_bytes()
    assert len(data) >= size, f"{path} has {len(data)} bytes, expected at least {size}"
    nonzero = len(data) - len(data[size:].lstrip(b"\0"))
    assert nonzero == len(data), (f"{path}: a non-zero byte at offset {nonzero}, after the "
                                  f"{size} bytes of data: {data[nonzero:nonzero + 32]!r}")
    return data[:size]
