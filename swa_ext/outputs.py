"""Report files of the ``swa-ext`` commands: each output path is proven writable
before any work, by creating the file, and each report is written to a temporary
file beside it and renamed into place, so a failed or interrupted run leaves nothing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class OutputError(Exception):
    """An output path that cannot be written: the message is the one line to print."""


def image_formats() -> dict[str, str]:
    """The image formats a plot can be written as (matplotlib's), by suffix."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    return FigureCanvasBase.get_supported_filetypes()


def check_output(where: str, path: str, *, image: bool = False) -> None:
    """Raise ``OutputError`` (its message starts with ``where``) unless ``path`` can be
    written: a file is created there and removed again (an existing file is opened for
    appending and left as it is). Trying is the only check that holds for root, for
    read-only mounts and for /proc or /sys. An image's suffix must name a format."""
    if not path:
        raise OutputError(f"{where}: an empty path")
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{where} {path}: is a directory, not a file name")
    if target.exists() and not target.is_file():
        # A report is renamed into place: it must not replace a device or a pipe.
        raise OutputError(f"{where} {path}: is not a regular file")
    if image:
        suffix = target.suffix.lstrip(".").lower()
        formats = image_formats()
        if suffix not in formats:
            raise OutputError(f"{where} {path}: unknown image format {suffix!r}; name it *.png "
                              f"(or one of {', '.join(sorted(formats))})")
    parent = target.absolute().parent
    if not parent.is_dir():
        raise OutputError(f"{where} {path}: no directory {parent}")
    existed = target.exists()
    try:
        with open(target, "a" if existed else "x", encoding="utf-8"):
            pass
        if not existed:
            target.unlink()
    except OSError as e:
        raise OutputError(f"{where} {path}: not writable ({e.strerror or e})") from None


def write_all(reports) -> list[str]:
    """Write every report of ``reports`` (pairs of a path and ``write(temporary_path)``)
    to a temporary file beside its path, then rename them all into place: an error or
    Ctrl-C while writing leaves none of them and no temporary file. The paths written."""
    temps: list[tuple[str, str]] = []
    umask = os.umask(0)
    os.umask(umask)
    try:
        for path, write in reports:
            target = Path(path).resolve()  # through a symbolic link, not over it
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix,
                                       dir=target.absolute().parent)
            os.close(fd)
            temps.append((tmp, str(target)))
            os.chmod(tmp, 0o666 & ~umask)  # what open() would have given the file
            write(tmp)
        for tmp, target in temps:
            os.replace(tmp, target)
    except BaseException:
        for tmp, _ in temps:
            Path(tmp).unlink(missing_ok=True)
        raise
    return [path for path, _ in reports]
