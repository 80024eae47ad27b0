"""Files written atomically: to a temporary name beside the target, fsynced, then renamed over
it, so a reader (or a crash) never sees half a checkpoint or model."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ._array_bytes import write_pieces


def temp_beside(dst: Path):
    folder = dst.parent if str(dst.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{dst.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def atomic_write(dst: Path, pieces, data=(), data_path: Path | None = None) -> None:
    temps = []
    try:
        if data:
            fd, tmp = temp_beside(data_path)
            temps.append((tmp, data_path))
            with os.fdopen(fd, "wb") as out:
                for offset, value in data:
                    out.seek(offset)
                    value.write_to(out)
                out.flush()
                os.fsync(out.fileno())
        fd, tmp = temp_beside(dst)
        temps.append((tmp, dst))
        with os.fdopen(fd, "wb") as out:
            write_pieces(out, pieces)
            out.flush()
            os.fsync(out.fileno())
        for tmp, final in temps:  # the data file first: the model never points at missing data
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
