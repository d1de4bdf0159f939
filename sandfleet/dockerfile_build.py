"""A Dockerfile's plan (sandfleet.dockerfile) built on the platform: each group of steps up to
a RUN in one build sandbox (SandboxSpec.build) over the stack so far, its writable layer
captured (a checkpoint) as the next layer, the result a named stack with the image config the
Dockerfile sets. Its sandboxes are the platform's own account's: a tenant is refused one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from sandfleet import errors
from sandfleet.dockerfile import Copy, DockerfileError, Run, parse, plan
from sandfleet.oci_archive import ROOT_USERS
from schemas.layers import ImageConfig

CHOWN_BATCH = 512  # paths per `chown`/`chmod` argv of a COPY --chown/--chmod


def groups(steps: list[Copy | Run | str]) -> list[list[Copy | Run | str]]:
    """The steps, cut after each RUN: one build sandbox each (what a RUN writes is captured
    before the next one runs, so each RUN is a layer); what follows the last RUN, if anything,
    is one more. Every command of a build sandbox runs as its RUN's user, and a COPY may need
    root's (_copy_into), so a COPY before a RUN of another user gets a sandbox of its own."""
    found: list[list[Copy | Run | str]] = [[]]
    for item in steps:
        if isinstance(item, Run) and item.user and any(isinstance(i, Copy) for i in found[-1]):
            found.append([])
        found[-1].append(item)
        if isinstance(item, Run):
            found.append([])
    return [g for g in found if g]


def _user_of(group: list[Copy | Run | str]) -> str:
    return next((item.user for item in group if isinstance(item, Run)), "")


async def build(fleet, layers, name: str, dockerfile: Path, context: Path, *, build_args: dict[str, str] | None = None,
                isolation: str = "container", tags: list[str] | None = None, allow: list[str] | None = None,
                log=print):
    """Build `dockerfile` over its FROM and record the result as stack `name`; returns its BuildReply.
    `fleet` is a `sandfleet.Fleet` of the platform's own account (a build sandbox is refused to
    a tenant), `layers` a `sandfleet.layers_client.Layers`; `allow`: the RUN steps' network
    (allow rules, as `fleet.create` takes them; none by default)."""
    instructions = parse(dockerfile.read_text())
    first = plan(instructions, context, None, build_args)
    token = secrets.token_hex(3)
    scratch: list[str] = []  # names made on the way, removed at the end (their images stay under `name`)
    try:
        base = first.base
        candidate = Path(base) if Path(base).is_absolute() else (dockerfile.parent / base)
        if candidate.is_file():
            base = f"{name[:50]}-from-{token}"
            log(f"FROM {first.base}: importing the archive as {base}")
            await layers.import_image(base, candidate)
            scratch.append(base)
        try:
            base_layer = await layers.get(base)
        except errors.NotFound:
            raise DockerfileError(f"FROM {first.base}: no such layer or image, and no such archive file") from None
        result = plan(instructions, context, base_layer.config, build_args)
        steps = groups(result.steps)
        # Each build sandbox's commands run as its stack's image User says: the USER of its RUN.
        current = base
        if steps and _user_of(steps[0]) != _normal_user(base_layer.config):
            current = await _named(layers, f"{name[:40]}-{token}-0-as", [base], _user_of(steps[0]), scratch)
        for number, group in enumerate(steps, 1):
            after = _user_of(steps[number]) if number < len(steps) else ""
            current = await _one_step(fleet, layers, current, group, f"{name[:40]}-{token}-{number}", after,
                                      isolation, allow or [], scratch, log)
        return await layers.stack(name, [current], result.config, tags=tags or [])
    finally:
        for leftover in reversed(scratch):
            try:
                await layers.remove(leftover)
            except errors.SandfleetError:
                pass


def _normal_user(config: ImageConfig | None) -> str:
    user = config.user if config is not None else ""
    return "" if user in ROOT_USERS else user


async def _named(layers, name: str, stack: list[str], user: str, scratch: list[str]) -> str:
    await layers.stack(name, stack, ImageConfig(user=user))
    scratch.append(name)
    return name


async def _one_step(fleet, layers, current: str, steps: list, prefix: str, next_user: str, isolation: str,
                    allow: list[str], scratch: list[str], log) -> str:
    """Run `steps` in one build sandbox over `current`, capture its writable layer, and name the
    stack so far (one reference, so a long Dockerfile never passes the layers a spec takes),
    its User the one the next step's RUN runs as."""
    sb = await fleet.create(isolation=isolation, layers=[current], memory_mb=1024, timeout_s=3600, build=True,
                            allow=allow)
    try:
        for item in steps:
            if isinstance(item, str):
                await sb.files.mkdir(item, parents=True)
            elif isinstance(item, Copy):
                await _copy_into(sb, item, log)
            else:
                log(f"line {item.line}: RUN {' '.join(item.argv)[:100]}")
                await sb.files.mkdir(item.cwd, parents=True)
                r = await sb.exec(item.argv, env=item.env, cwd=item.cwd, timeout_s=3600)
                if r.exit_code != 0:
                    tail = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()[-3:]
                    raise errors.InvalidRequest(f"line {item.line}: RUN exited {r.exit_code}: {' | '.join(tail)}")
        checkpoint = await sb.checkpoint(prefix)
    finally:
        await sb.destroy()
    scratch.append(checkpoint.name)
    return await _named(layers, prefix + "-s", [current, checkpoint.name], next_user, scratch)


async def _copy_into(sb, item: Copy, log) -> None:
    """Upload the sources, then give what was written the `--chown` owner and `--chmod` mode
    with the image's own chown and chmod (names looked up in its own /etc/passwd and /etc/group,
    as docker does; links are not followed). The node writes as the sandbox's root without its
    capabilities, so a directory only another user may write (a home under USER) refuses the
    upload: then it goes to a staging directory and root's `cp -a` in the build sandbox, which
    holds DAC override, puts it in place."""
    log(f"line {item.line}: COPY {' '.join(p.name for p in item.sources)} {item.dest}")
    written: list[tuple[str, bool]] = []  # (path in the image, is a symlink)
    for source in item.sources:
        target = os.path.join(item.dest, source.name) if item.into_dir and source.is_file() else item.dest
        try:
            await sb.files.mkdir(os.path.dirname(target) if source.is_file() else target, parents=True)
            await sb.upload(source, target)
        except errors.InvalidRequest as exc:
            if "EACCES" not in str(exc):
                raise
            await _staged_upload(sb, item, source, target)
        written.append((target, False))
        if source.is_dir():
            for top, dirs, files in os.walk(source):
                for entry in (*dirs, *files):
                    path = os.path.join(top, entry)
                    written.append((os.path.join(target, os.path.relpath(path, source)), os.path.islink(path)))
    tools = ([(["chown", "-h", item.chown], True)] if item.chown else []) + \
        ([(["chmod", item.chmod], False)] if item.chmod else [])
    for argv, links_too in tools:
        paths = [path for path, link in written if links_too or not link]
        for at in range(0, len(paths), CHOWN_BATCH):
            r = await sb.exec([*argv, "--", *paths[at:at + CHOWN_BATCH]], cwd="/", timeout_s=600)
            if r.exit_code != 0:
                why = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()[-1:]
                raise errors.InvalidRequest(f"line {item.line}: COPY --{argv[0]}={argv[-1]}: {' '.join(why)}")


async def _staged_upload(sb, item: Copy, source: Path, target: str) -> None:
    staging = f"/.sandfleet-copy-{secrets.token_hex(4)}"  # the node may write the root's top level
    await sb.files.mkdir(staging, parents=True)
    await sb.upload(source, f"{staging}/{source.name}")
    script = ('mkdir -p -- "$(dirname -- "$2")" && if [ -d "$1" ]; then mkdir -p -- "$2" && cp -a -- "$1/." "$2/"; '
              'else cp -a -- "$1" "$2"; fi; done=$?; rm -rf -- "$3"; exit $done')
    r = await sb.exec(["/bin/sh", "-c", script, "copy", f"{staging}/{source.name}", target, staging], cwd="/",
                      timeout_s=3600)
    if r.exit_code != 0:
        why = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()[-1:]
        raise errors.InvalidRequest(f"line {item.line}: COPY {source.name} {target}: {' '.join(why)}")
