"""Safe output on disk: fsync, checksums, atomic files and folders, the overwrite rule.

The one implementation for `data/` and every floor above it (`models/`, `scripts/`).
`sparse/` and `dense/` are ground floors too and may not import this module; where they
need the same thing they keep a short copy that says so.

    out = claim_output_dir(args.out, overwrite=args.overwrite, manifest="manifest.json", format="x/1")
    tmp = staging_dir(out)           # hidden, beside `out`: the final rename is atomic
    ... write into tmp ...
    publish_dir(tmp, out)            # readers see the old folder or the new one, never half

The overwrite rule: an output folder may be absent or empty; a non-empty one is replaced
only with `overwrite`, and only when it holds a genrec output of the same kind (its
manifest, with the same format) and, where the manifest lists its files, nothing else (a
user's notes, a link or an empty folder of theirs, or the very input being converted).
Anything else is refused, naming the path, so that `--overwrite` never deletes what genrec
did not write.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath


def check_utf8(values) -> None:
    """ValueError naming the first string of `values` (or of a list among them) that is not
    valid UTF-8: a path of other bytes, which Python keeps as surrogates. Parquet, JSON and
    TOML take only UTF-8, and each failed deep inside with a codec error naming no path."""
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    shown = os.fsencode(item).decode("utf-8", "backslashreplace")
                    raise ValueError(f"argument '{shown}' is not valid UTF-8: rename the path, or give it "
                                     "through a link whose name is UTF-8") from None


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory needs its own fsync so that a rename or a
    new entry in it survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temp file in the same folder, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: object) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


class OutputExistsError(FileExistsError, ValueError):
    """A non-empty output folder that may not be replaced (a ValueError too, so callers
    that report bad input catch it)."""


def holds_output(out: Path, manifest: str, format: str | None = None) -> bool:
    """Whether folder `out` holds a genrec output of this kind: `out/manifest` is a JSON
    object, with `"format": format` when `format` is given."""
    try:
        meta = json.loads((out / manifest).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and (format is None or meta.get("format") == format)


def claim_output_dir(out_dir: str | os.PathLike, *, overwrite: bool, manifest: str,
                     format: str | None = None, flag: str = "--overwrite") -> Path:
    """Check `out_dir` before any work starts (see the module docstring); returns it as an
    absolute Path. Nothing is removed here: `publish_dir` replaces the folder at the end."""
    # Absolute: the staging folder goes beside `out` (in its parent, under its name) and is
    # renamed onto it; `.` has no name, and its parent would be itself.
    out = Path(os.path.abspath(out_dir))
    if not out.exists():
        # A file where a parent folder should be would only fail at the end, after the work.
        for parent in out.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise OutputExistsError(f"output path {out} cannot be made: {parent} is a file, not a folder")
                break
        return out
    if not out.is_dir():
        raise OutputExistsError(f"output path {out} exists and is not a directory")
    if not any(out.iterdir()):
        return out
    kind = f"{manifest}" + (f" with format {format!r}" if format else "")
    if not overwrite:
        raise OutputExistsError(f"output directory {out} exists and is not empty: pass {flag} to replace it "
                         "(allowed only for a genrec output of the same kind), or choose another output")
    if not holds_output(out, manifest, format):
        raise OutputExistsError(f"refusing to replace {out}: it is not a genrec output of this kind (no {kind} in it); "
                         "remove it yourself or choose another output")
    foreign = _unlisted_entries(out, manifest)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputExistsError(f"refusing to replace {out}: it holds files its {manifest} does not list ({shown}), "
                                "which replacing it would delete; move them away or choose another output")
    return out


def _unlisted_entries(out: Path, manifest: str) -> list[str]:
    """Entries under `out` that its manifest's file list (`files` or `outputs`: names, or a
    mapping by name) does not name, the manifest aside; none to check where it lists none.
    A folder is the output's own only while it holds a listed name: a link (to a folder
    too) or an empty folder that is not listed is someone else's, and is reported whole."""
    meta = json.loads((out / manifest).read_text())
    listed: set[str] = set()
    for key in ("files", "outputs"):
        value = meta.get(key)
        if isinstance(value, (dict, list)):
            listed.update(str(name) for name in value)
    if not listed:
        return []
    own_dirs = {parent.as_posix() for name in listed for parent in PurePosixPath(name).parents}
    unlisted = []
    # os.walk lists a link to a folder among the folders and, unasked, never follows it.
    for root, dirs, files in os.walk(out):
        rel_root = Path(root).relative_to(out)
        descend = []
        for name in dirs:
            rel = (rel_root / name).as_posix()
            if rel in listed:
                continue
            if rel in own_dirs and not os.path.islink(os.path.join(root, name)):
                descend.append(name)
            else:
                unlisted.append(rel)
        dirs[:] = descend
        unlisted += [rel for rel in ((rel_root / name).as_posix() for name in files)
                     if rel not in listed and rel != manifest]
    return sorted(unlisted)


def _host() -> str:
    return socket.gethostname().replace("/", "_")


def _writer_tag() -> str:
    """This host and process, in the names of the hidden folders beside an output."""
    return f"{_host()}-{os.getpid()}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_abandoned(out: Path) -> list[Path]:
    """Remove the hidden folders beside `out` that a writer of this host left behind when it
    was killed before cleaning up (kill -9, an OOM kill): a staging folder it was filling,
    or the earlier output it had moved aside once `out` holds the new one (without `out`,
    that is the only copy: it stays, and is named). Only folders named by `staging_dir` /
    `publish_dir` for this host and a process no longer running here are touched; another
    host's (a shared filesystem) or a live writer's stay. Returns what was removed."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-{re.escape(_host())}-(\d+)-[A-Za-z0-9_]+")
    removed = []
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*")):
        found = pattern.fullmatch(path.name)
        if not found or not path.is_dir() or path.is_symlink() or _running(int(found.group(2))):
            continue
        if found.group(1) == "old" and not out.exists():
            print(f"note: {path} holds the output that was at {out} before a killed process replaced it; "
                  f"move it back to {out} to keep it", file=sys.stderr, flush=True)
            continue
        print(f"removing {path}: left unfinished by process {found.group(2)}, which is no longer running",
              file=sys.stderr, flush=True)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def directory_identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of the folder at `path` now, links followed; None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def unreplaced(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Reading an output's files by path: `publish_dir` may rename a new folder into place
    meanwhile, and the files read would mix the two. Raises ValueError (naming `what`) if the
    folder at `path` is not the same one after the block as before it."""
    before = directory_identity(path)
    yield
    if directory_identity(path) != before:
        raise ValueError(f"{what} {path}: the directory was replaced while it was read (an export published "
                         "over it); read it again")


def staging_dir(out: Path) -> Path:
    """A fresh hidden folder beside `out` (same filesystem, so `publish_dir` is one rename),
    named for this host and process, so that a later writer can tell it abandoned (see
    `remove_abandoned`, done here first)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{_writer_tag()}-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; outputs are meant to be read by others
    return tmp


def publish_dir(staging: Path, out: Path, *, manifest: str | None = None, format: str | None = None) -> Path:
    """Rename `staging` to `out`. An existing non-empty `out` is moved aside first and then
    removed; with `manifest`, only if it still holds an output of that kind (it may have
    been filled by someone else while we were writing)."""
    # Every file and folder on disk before the rename makes them the output: after a crash
    # the published folder holds complete files, never the zero-length or partly written
    # ones that a rename ahead of the data's writeback can leave.
    for path in sorted(staging.rglob("*"), reverse=True):
        if not path.is_symlink():
            fsync_path(path)
    fsync_path(staging)
    old = None
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            if manifest is not None and not holds_output(out, manifest, format):
                raise OutputExistsError(f"{out} appeared while writing and is not a genrec output of this kind; "
                                 "refusing to replace it (this run's output is discarded)")
            foreign = _unlisted_entries(out, manifest) if manifest is not None else []
            if foreign:  # put there while we were writing: claim_output_dir saw none
                raise OutputExistsError(f"refusing to replace {out}: files its {manifest} does not list appeared "
                                        f"while writing ({', '.join(foreign[:5])}); move them away and run again "
                                        f"(this run's output is discarded)")
            old = out.parent / f".{out.name}.old-{_writer_tag()}-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
    os.rename(staging, out)
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
