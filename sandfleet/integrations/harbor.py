"""Harbor on sandfleet: an environment class (Harbor's `BaseEnvironment`) whose trials run in
sandfleet sandboxes, loaded by Harbor's own `--env module:Class` option:

    harbor run -p TASK_DIR --agent oracle --env sandfleet.integrations.harbor:SandfleetEnvironment \\
        --ek url=nats://127.0.0.1:4222

Harbor needs Python >= 3.12 (its own code uses 3.12 syntax), so this module works only there;
it stays valid 3.11 syntax so the SDK's tree compiles on the 3.11 it supports, and importing it
on 3.11 says what to do. The README's "Use it from Harbor" says how to get a 3.12+ on Debian 12.

The task's environment becomes a sandfleet layer:
- `environment/Dockerfile` is built by sandfleet's own builder (sandfleet/dockerfile_build.py)
  into layer `harbor-<content hash>`, once: a later trial (or run) of the same definition over the
  same base reuses it unless Harbor forces a build. Its FROM is a sandfleet layer (`FROM base`, or
  `FROM python:3.12` for a layer `python` tagged `3.12`, as `sandfleet layer import` makes from an
  image archive), an image archive beside the Dockerfile, or an image reference the `images`
  option maps to a layer (`--ek images='{"ubuntu:24.04": "ubuntu"}'`). A FROM that is none of
  these (a registry image nobody imported) fails the build, non-retryable, saying so: sandfleet
  does not pull from registries; `sandfleet layer import` an archive of it first.
- a task with only `docker_image` runs over the layer that reference names (through `images`
  first), and Harbor uploads the environment dir into it after start, as for its other providers.
- docker-compose environments are refused (one sandbox per trial).
The trial's sandbox runs over that image and one more layer holding Harbor's top-level dirs
(/logs, /tests, /solution, ...): a sandbox may not create entries at its root (linuxnode/landlock.py).

Commands run as the sandbox's image User (sandfleet has no per-command user switch): an exec
asking for another user is refused, so a task whose Dockerfile sets a non-root USER cannot run
Harbor's root housekeeping (Harbor's verifier runs `rm` as root). Network: Harbor's
`no-network` is sandfleet's default (no egress), `allowlist` entries become allow rules
(names, wildcards, addresses, CIDRs), `public` becomes every address (`public_allow`); the
policy is fixed at start. Files go through the SDK's transfers (any size, checked end to end);
a directory upload merges into what is there, as `docker cp` does. Building a layer needs the
platform's own account (a tenant is refused build sandboxes): a tenant's credentials run tasks
whose layer exists already.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import posixpath
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

if sys.version_info < (3, 12):  # pragma: no cover - the SDK's own floor is 3.11
    raise ImportError("sandfleet.integrations.harbor needs Python >= 3.12, as Harbor itself does "
                      f"(this is {sys.version.split()[0]}); README.md 'Use it from Harbor' says how to get one")

from sandfleet.extras import MissingExtra

try:
    from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
    from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
    from harbor.environments.definition import COMPOSE_FILE_NAME, DOCKERFILE_NAME, require_agent_environment_definition
    from harbor.environments.options import EnvironmentOptions
    from harbor.models.task.config import NetworkMode
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - only without the extra
    raise MissingExtra("harbor", "sandfleet.integrations.harbor", ["harbor"]) from exc

import sandfleet
from sandfleet import dockerfile_build, errors
from sandfleet.dockerfile import DockerfileError, parse, plan
from sandfleet.layers_client import Layers
from sandfleet.oci_archive import ROOT_USERS

__all__ = ["SandfleetEnvironment", "SandfleetOptions"]

MAX_EXEC_S = 24 * 3600  # what the node takes for one command: Harbor's "no timeout"
EVERY_ADDRESS = ["0.0.0.0/0", "::/0"]
# Where Harbor puts logs, tests, the solution, skills and installed agents (EnvironmentPaths)
HARBOR_DIRS = ("logs", "tests", "solution", "runtime", "installed-agent")
HARBOR_DIRS_LAYER = "harbor-dirs-v1"
_BUILDS: dict[str, asyncio.Lock] = {}  # one build of a layer at a time in this process (concurrent trials)


class SandfleetOptions(EnvironmentOptions):
    """What `--ek key=value` sets for SandfleetEnvironment."""

    url: str | None = Field(default=None, description="The platform's bus (default $SANDFLEET_NATS_URL, "
                                                       "else nats://127.0.0.1:4222).")
    creds: str | None = Field(default=None, description="A bus credentials file (default $SANDFLEET_CREDS, "
                                                        "else the operator's of a platform on this machine).")
    isolation: str = Field(default="container", description="The trial sandbox's level: process, container, "
                                                            "microvm or vm.")
    build_isolation: str = Field(default="container", description="The level the Dockerfile's RUN steps run at.")
    build_allow: list[str] = Field(default_factory=list, description="Network the Dockerfile's RUN steps may "
                                                                     "reach (allow rules; none by default).")
    images: dict[str, str] = Field(default_factory=dict, description="Image reference (a FROM, a docker_image) "
                                                                     "-> the sandfleet layer that stands for it.")
    public_allow: list[str] = Field(default_factory=lambda: list(EVERY_ADDRESS),
                                    description="What network_mode='public' allows (allow rules).")
    memory_mb: int = Field(default=2048, description="Memory when the task sets none.")
    disk_mb: int = Field(default=2048, description="Writable space (MiB, counted in memory) when the task "
                                                   "sets no storage_mb.")
    sandbox_timeout_s: int = Field(default=24 * 3600, description="The sandbox ends by itself after this long "
                                                                  "(a Harbor that died before stop()).")


class SandfleetEnvironment(BaseEnvironment):
    """One trial's sandbox, made by `start()` and destroyed by `stop()`, on its own connection."""

    options_model = SandfleetOptions
    options: SandfleetOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fleet: sandfleet.Fleet | None = None
        self._sandbox: sandfleet.Sandbox | None = None
        self._shell = "sh"
        self._image_user = ""
        self._workdir = "/"

    @staticmethod
    def type() -> str:
        return "sandfleet"

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True, network_allowlist=True, network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True, network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv6_addresses=True, network_allowlist_ipv4_cidrs=True,
            network_allowlist_ipv6_cidrs=True)

    def _validate_definition(self) -> None:
        if (self.environment_dir / COMPOSE_FILE_NAME).exists():
            raise ValueError(f"{COMPOSE_FILE_NAME}: sandfleet runs one sandbox per trial, not a compose project")
        if self._host_mounts:  # a user's mounts (Harbor's own output dirs are made in the sandbox instead)
            raise ValueError("mounts: sandfleet binds no host path into a sandbox (the node enters it from "
                             "outside; Harbor's uploads and downloads move the files)")
        require_agent_environment_definition(self.environment_dir, docker_image=self.task_env_config.docker_image)

    @property
    def sandbox(self) -> sandfleet.Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the sandfleet environment is not started")
        return self._sandbox

    # -- life ----------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        self._fleet = await sandfleet.connect(self.options.url, name=f"harbor-{self.session_id}"[:64],
                                              creds=self.options.creds)
        try:
            layers = Layers(self._fleet.bus)
            name = await self._layer(layers, force_build)
            config = (await layers.get(name)).config
            self._image_user = config.user if config is not None else ""
            self._workdir = self.task_env_config.workdir or (config.working_dir if config else "") or "/"
            self._sandbox = await self._fleet.create(
                isolation=self.options.isolation, layers=[name], cpu=float(self._effective_cpus or 1),
                memory_mb=self._effective_memory_mb or self.options.memory_mb,
                disk_mb=self._effective_storage_mb or self.options.disk_mb, timeout_s=self.options.sandbox_timeout_s,
                allow=self._allow(), labels={"harbor.session": self.session_id[:256]})
            has_bash = await self._sandbox.exec(["sh", "-c", "command -v bash"], cwd="/")
            self._shell = "bash" if has_bash.exit_code == 0 else "sh"  # Harbor's docker runs `bash -c`
            await self.ensure_dirs(self._mount_targets(writable_only=True))  # /logs/agent, /logs/verifier, ...
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        """Destroys the sandbox whatever `delete` says: a sandbox is disposable, and one kept
        would only wait for its timeout."""
        sandbox, self._sandbox = self._sandbox, None
        fleet, self._fleet = self._fleet, None
        try:
            if sandbox is not None:
                try:
                    await sandbox.destroy()
                except (errors.NotFound, errors.Conflict):  # it ended by itself, or is ending
                    pass
        finally:
            if fleet is not None:
                await fleet.close()

    def _allow(self) -> list[str]:
        mode = self.network_policy.network_mode
        if mode == NetworkMode.NO_NETWORK:
            return []
        if mode == NetworkMode.ALLOWLIST:
            return list(self.network_policy.allowed_hosts)
        return list(self.options.public_allow)

    # -- the layer ------------------------------------------------------------------------

    def _image(self, reference: str) -> str:
        return self.options.images.get(reference, reference)

    async def _layer(self, layers: Layers, force_build: bool) -> str:
        """The stack the trial's sandbox runs over: the task's image, and the top-level dirs
        Harbor writes (a sandbox may not create top-level entries: linuxnode/landlock.py)."""
        image = await self._task_image(layers, force_build)
        built = await layers.get(image)
        name = f"harbor-{_digest(built.digest, HARBOR_DIRS_LAYER)[:24]}"
        async with _BUILDS.setdefault(name, asyncio.Lock()):
            if force_build or not await _exists(layers, name):
                await layers.stack(name, [image, await _harbor_dirs(layers)], built.config)
        return name

    async def _task_image(self, layers: Layers, force_build: bool) -> str:
        dockerfile = self.environment_dir / DOCKERFILE_NAME
        if not dockerfile.exists():
            reference = self._image(self.task_env_config.docker_image or "")
            await _base_layer(layers, reference, f"docker_image {self.task_env_config.docker_image!r}")
            return reference
        try:
            text, base = self._dockerfile(dockerfile.read_text())
        except DockerfileError as exc:
            raise SandboxBuildFailedError(f"{dockerfile}: {exc}") from None
        archive = Path(base) if Path(base).is_absolute() else dockerfile.parent / base
        # The base's build is part of the key: a layer name moved to a new build is a new image
        base_digest = "" if archive.is_file() else await _base_layer(layers, base, f"{dockerfile}: FROM {base}")
        name = f"harbor-image-{_digest(self.environment_id, text, base_digest, self.options.build_isolation)[:24]}"
        async with _BUILDS.setdefault(name, asyncio.Lock()):
            if force_build or not await _exists(layers, name):
                await self._build(layers, name, dockerfile, text)
        return name

    def _dockerfile(self, text: str) -> tuple[str, str]:
        """The Dockerfile with its FROM mapped through `images`, and that FROM."""
        found = plan(parse(text), self.environment_dir, None).base
        base = self._image(found)
        if base == found:
            return text, base
        start = next(i.line for i in parse(text) if i.keyword == "FROM")
        lines = text.splitlines()
        end = start
        while end < len(lines) and lines[end - 1].rstrip().endswith("\\"):
            end += 1
        return "\n".join([*lines[:start - 1], f"FROM {base}", *lines[end:]]) + "\n", base

    async def _build(self, layers: Layers, name: str, dockerfile: Path, text: str) -> None:
        assert self._fleet is not None
        with tempfile.TemporaryDirectory(prefix="sandfleet-harbor-") as tmp:
            if text != dockerfile.read_text():  # a mapped FROM: the context stays the task's own
                dockerfile = Path(tmp) / DOCKERFILE_NAME
                dockerfile.write_text(text)
            build = dockerfile_build.build(self._fleet, layers, name, dockerfile, self.environment_dir,
                                           isolation=self.options.build_isolation, allow=self.options.build_allow,
                                           log=self.logger.debug)
            try:
                await asyncio.wait_for(build, self.task_env_config.build_timeout_sec)
            except (DockerfileError, errors.SandfleetError) as exc:
                raise SandboxBuildFailedError(f"building {dockerfile} as layer {name}: {exc}") from exc

    # -- commands ---------------------------------------------------------------------------

    def _check_user(self, user: str | int | None) -> None:
        if user is None:
            return
        image = self._image_user
        if str(user) == image or str(user) == image.partition(":")[0]:
            return
        if str(user) in ("root", "0") and image in ROOT_USERS:
            return
        raise RuntimeError(f"sandfleet runs every command of a sandbox as its image's User "
                           f"({image or 'root'}); a command as {user!r} is not supported")

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        self._check_user(self._resolve_user(user))
        timeout = min(timeout_sec, MAX_EXEC_S) if timeout_sec else MAX_EXEC_S
        streams: dict[str, Any] = {}
        if (callback := self._output_callback()) is not None:
            streams = {"on_stdout": _emitter(callback, "stdout"), "on_stderr": _emitter(callback, "stderr")}
        r = await self.sandbox.exec([self._shell, "-c", command], cwd=self._path(cwd or "."), timeout_s=timeout,
                                    env=self._merge_env(env) or {}, **streams)  # the task's env is in it
        if r.timed_out:  # as Harbor's docker environment says it
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        if r.truncated:
            self.logger.warning(f"the output of {command[:80]!r} was cut at the node's limit")
        return ExecResult(stdout=r.stdout.decode(errors="replace"), stderr=r.stderr.decode(errors="replace"),
                          return_code=r.exit_code)

    # -- files ------------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self._workdir, str(path)))

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._path(target_path)
        await self.sandbox.files.mkdir(posixpath.dirname(target), parents=True)
        await self.sandbox.upload(Path(source_path), target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """The directory's contents into `target_dir`, merged with what is there (`docker cp
        DIR/. TARGET`): a subtree the sandbox lacks goes in one transfer, the rest entry by entry."""
        await self._merge(Path(source_dir), self._path(target_dir))

    async def _merge(self, source: Path, target: str) -> None:
        if not await self.sandbox.files.exists(target):
            await self.sandbox.files.mkdir(posixpath.dirname(target), parents=True)
            await self.sandbox.upload(source, target)
            return
        for child in sorted(source.iterdir()):
            into = posixpath.join(target, child.name)
            if child.is_dir() and not child.is_symlink():
                await self._merge(child, into)
            else:
                await self.sandbox.upload(child, into)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        await self.sandbox.download(self._path(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """The directory's contents into the local `target_dir`, overwriting what the sandbox
        also has and keeping the rest, as Harbor's other environments do."""
        with tempfile.TemporaryDirectory(prefix="sandfleet-harbor-") as tmp:
            landed = Path(tmp) / "dir"
            await self.sandbox.download(self._path(source_dir), landed)
            await asyncio.to_thread(shutil.copytree, landed, target_dir, symlinks=True, dirs_exist_ok=True)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


async def _exists(layers: Layers, name: str) -> bool:
    try:
        await layers.get(name)
        return True
    except errors.NotFound:
        return False


async def _base_layer(layers: Layers, reference: str, what: str) -> str:
    """The digest of the layer `reference` names; a missing one is the task's build failing."""
    try:
        return (await layers.get(reference)).digest
    except (errors.NotFound, errors.InvalidRequest):
        raise SandboxBuildFailedError(
            f"{what}: no sandfleet layer {reference!r} (sandfleet pulls from no registry: `sandfleet layer import "
            "NAME ARCHIVE` makes one of an image archive; map the reference to it with "
            "--ek images='{\"<image>\": \"NAME\"}')") from None


async def _harbor_dirs(layers: Layers) -> str:
    """The layer of Harbor's top-level dirs (empty, root's), made once per platform."""
    async with _BUILDS.setdefault(HARBOR_DIRS_LAYER, asyncio.Lock()):
        if not await _exists(layers, HARBOR_DIRS_LAYER):
            with tempfile.TemporaryDirectory(prefix="sandfleet-harbor-") as tmp:
                for top in HARBOR_DIRS:
                    (Path(tmp) / top).mkdir(mode=0o755)
                await layers.build_dir(HARBOR_DIRS_LAYER, tmp)
    return HARBOR_DIRS_LAYER


def _emitter(callback: Any, stream: str) -> Any:
    """An SDK output callback handing Harbor's callback text, whole characters only."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    async def emit(chunk: bytes) -> None:
        if text := decoder.decode(chunk):
            await callback(text, stream)

    return emit
