"""Where the `ntl-patch` binary is: the wheel installs it into the environment's scripts folder.

Order: $NTL_PATCH_BIN (a path to the binary; overrides everything), the scripts folder of this
interpreter's environment (``sysconfig.get_path("scripts")``, the folder beside
``sys.executable``, the user scheme's for ``pip install --user``), then PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

ENV = "NTL_PATCH_BIN"
NAME = "ntl-patch.exe" if os.name == "nt" else "ntl-patch"


class BinaryNotFound(Exception):
    """No usable ntl-patch binary (the message says where it looked)."""


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def candidates() -> list[Path]:
    """The scripts folders this environment's pip installs console scripts into."""
    dirs = []
    for getter in (lambda: sysconfig.get_path("scripts"),
                   lambda: str(Path(sys.executable).parent),
                   lambda: sysconfig.get_path("scripts", f"{os.name}_user")):
        try:
            d = getter()
        except (KeyError, ValueError, OSError):
            continue
        if d and Path(d) / NAME not in dirs:
            dirs.append(Path(d) / NAME)
    return dirs


def find() -> str:
    """The path of the binary to run; BinaryNotFound if there is none."""
    override = os.environ.get(ENV)
    if override:
        p = Path(override).expanduser()
        if not _executable(p):
            raise BinaryNotFound(f"{ENV}={override!r} is not an executable file; point it at an "
                                 f"ntl-patch binary or unset it")
        return str(p)
    for p in candidates():
        if _executable(p):
            return str(p)
    found = shutil.which(NAME)
    if found:
        return found
    looked = ", ".join(str(p.parent) for p in candidates())
    raise BinaryNotFound(f"the ntl-patch binary was not found (looked in {looked} and on PATH): "
                         f"install the wheel (`pip install ntl-patch`), or set {ENV} to a binary "
                         f"built with `cargo build`")
