"""An imported image's config applied to the commands run in a sandbox over it.

The layer-cache hands the config back with the composed root (`Rootfs.config`), so a sandbox's
image config costs the launch nothing. The image's `Env` lies under each command's own env, its
`WorkingDir` replaces the default cwd (a command that names a cwd keeps it), and a command that
asks for the image's command (`image_command`) runs its `Entrypoint` followed by its own argv,
or by the image's `Cmd` when it gives none, as `docker run IMAGE [ARGS]` does. Its `User`
("app", "1000", "app:staff", "1000:1000") is who each command runs as, names looked up in the
sandbox's own /etc/passwd and /etc/group as `docker run` looks them up (read from outside, once
per sandbox; the files are the sandbox's, so they are parsed as hostile input).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sandfleet.errors import ServiceError
from sandfleet.oci_archive import ROOT_USERS
from schemas.errors import ErrorCode
from schemas.layers import ImageConfig, Rootfs

if TYPE_CHECKING:
    from services.launcher.state import Live

DEFAULT_CWD = "/workspace"  # ExecRequest's and SpawnRequest's own default
ROOT = (-1, -1)  # no switch: the sandbox's root
MAX_IDS = 65536  # a sandbox's user namespace maps this many ids (linuxnode.userns.RANGE)
MAX_DB_BYTES = 4 << 20  # of /etc/passwd or /etc/group; a bigger one is not read


def resolve(rootfs: Rootfs | None, argv: list[str] | None, env: dict[str, str], cwd: str,
            image_command: bool) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, cwd) of a command, with the sandbox's image config (if any) applied."""
    config = rootfs.config if rootfs is not None else None
    if image_command:
        if config is None:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "image_command: this sandbox's layers carry no image config")
        argv = [*config.entrypoint, *(argv if argv else config.cmd)]
        if not argv:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "image_command: the image has no Entrypoint and no Cmd")
    elif not argv:
        raise ServiceError(ErrorCode.INVALID_REQUEST, "argv is required (or image_command=true)")
    if config is None:
        return list(argv), dict(env), cwd
    return list(argv), {**image_env(config), **env}, (config.working_dir or cwd) if cwd == DEFAULT_CWD else cwd


def image_env(config: ImageConfig) -> dict[str, str]:
    found = {}
    for entry in config.env:
        key, sep, value = entry.partition("=")
        if sep and key:
            found[key] = value
    return found


async def image_ids(live: Live) -> tuple[int, int]:
    """The (uid, gid) the sandbox's image says its commands run as (ROOT where it names none or
    root); looked up once per sandbox. A name the image's files lack is the caller's error."""
    if live.image_ids is None:
        config = live.rootfs.config if live.rootfs is not None else None
        user = config.user if config is not None else ""
        if user in ROOT_USERS:
            live.image_ids = ROOT
        else:
            passwd, group = await asyncio.gather(_read(live, "/etc/passwd"), _read(live, "/etc/group"))
            live.image_ids = ids_of(user, passwd, group)
    return live.image_ids


async def _read(live: Live, path: str) -> bytes:
    try:
        return await asyncio.to_thread(live.driver.read_file, live.instance, path, MAX_DB_BYTES)
    except (OSError, ValueError):  # missing, a link out, a directory, too big: no entries
        return b""


def ids_of(user: str, passwd: bytes, group: bytes) -> tuple[int, int]:
    """`User` as docker reads it: a name or number, then `:group` by name or number; a number
    not in /etc/passwd runs with gid 0, a name must be there."""
    name, _, group_name = user.partition(":")
    users = _entries(passwd, 4)  # name:x:uid:gid:...
    if name.isdigit():
        uid = int(name)
        gid = next((int(e[3]) for e in users if e[2] == name and e[3].isdigit()), 0)
    else:
        found = next((e for e in users if e[0] == name and e[2].isdigit() and e[3].isdigit()), None)
        if found is None:
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"the image's User {user!r}: no user {name!r} in the "
                                                          "sandbox's /etc/passwd")
        uid, gid = int(found[2]), int(found[3])
    if group_name:
        if group_name.isdigit():
            gid = int(group_name)
        else:
            entry = next((e for e in _entries(group, 3) if e[0] == group_name and e[2].isdigit()), None)
            if entry is None:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"the image's User {user!r}: no group {group_name!r} "
                                                              "in the sandbox's /etc/group")
            gid = int(entry[2])
    if not (0 <= uid < MAX_IDS and 0 <= gid < MAX_IDS):
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"the image's User {user!r}: ids past {MAX_IDS - 1} are "
                                                      "outside the sandbox's user namespace")
    return uid, gid


def _entries(data: bytes, fields: int) -> list[list[str]]:
    """The colon-separated lines of a passwd or group file with at least `fields` fields."""
    found = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        parts = line.split(":")
        if len(parts) >= fields and not line.startswith("#"):
            found.append(parts)
    return found
