"""A checkpoint's files as one uncompressed tar, streamed (never staged on disk or in memory).

What SDKs before 0.38 fetched through `get_checkpoint_archive_url` (a 302 to a signed link) and
what `lorafleet export` fetches: the checkpoint directory's visible regular files, flat, so a
reader extracts exactly those names. Every file is opened before the first byte goes out, so a
checkpoint deleted or overwritten mid-download (both rename directories, see fsio and
deletion.py) still streams the version the link was opened on, whole.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CHUNK_BYTES = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_END = b"\0" * (2 * _BLOCK)  # end-of-archive marker


def _padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)


def tar_stream(files: list[Path]) -> tuple[int, Iterator[bytes]]:
    """(exact byte length, chunks) of a tar holding `files` under their base names (0600)."""
    opened: list[tuple[BinaryIO, bytes, int]] = []
    try:
        for path in files:
            handle = path.open("rb")
            try:
                st = os.fstat(handle.fileno())
                info = tarfile.TarInfo(path.name)
                info.size, info.mode, info.mtime = st.st_size, 0o600, int(st.st_mtime)
                opened.append((handle, info.tobuf(format=tarfile.PAX_FORMAT), st.st_size))
            except BaseException:
                handle.close()
                raise
    except BaseException:
        for done, _, _ in opened:
            done.close()
        raise
    length = sum(len(header) + size + len(_padding(size)) for _, header, size in opened)

    def chunks() -> Iterator[bytes]:
        try:
            for handle, header, size in opened:
                yield header
                left = size
                while left:
                    data = handle.read(min(CHUNK_BYTES, left))
                    if not data:
                        raise RuntimeError(f"{handle.name} shrank while it was being sent")
                    left -= len(data)
                    yield data
                yield _padding(size)
            yield _END
        finally:
            for done, _, _ in opened:
                done.close()

    return length + len(_END), chunks()
