"""An imported image's config applied to the commands run in a sandbox over it.

The layer-cache hands the config back with the composed root (`Rootfs.config`), so a sandbox's
image config costs the launch nothing. The image's `Env` lies under each command's own env, its
`WorkingDir` replaces the default cwd (a command that names a cwd keeps it), and a command that
asks for the image's command (`image_command`) runs its `Entrypoint` followed by its own argv,
or by the image's `Cmd` when it gives none, as `docker run IMAGE [ARGS]` does.
"""

from __future__ import annotations

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import ImageConfig, Rootfs

DEFAULT_CWD = "/workspace"  # ExecRequest's and SpawnRequest's own default


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
