"""OCI images through the real platform: `layer import` of archives this test builds, one EROFS
layer per OCI layer shared by diff id, whiteouts as the image reads, the image config inside
`process` and `container` sandboxes over the imported stack, and Dockerfile builds.
"""

from __future__ import annotations

import gzip
import os
import secrets
import shutil
import subprocess
import tarfile

import msgspec
import nats
import pytest

from sandfleet import dockerfile, errors
from sandfleet.cli_layers import describe_import
from sandfleet.layers_client import Layers
from schemas.layers import DIFF_BUCKET, OBJECT_BUCKET, ImageConfig, StackLayer
from tests.kernel import require
from tests.layer_trees import make_busybox_base
from tests.oci_archives import Image, entry, file_member, layer_of_dir, layer_of_members, sha

CONFIG = {
    "Env": ["PATH=/usr/local/bin:/bin", "GREETING=from the image", "SHARED=image"],
    "WorkingDir": "/srv/app",
    "Entrypoint": ["/bin/sh", "-c", 'echo "entry:$GREETING:$0:$*:$(pwd)"'],
    "Cmd": ["default-arg"],
    "Labels": {"org.opencontainers.image.title": "oci-test"},
    "ExposedPorts": {"8080/tcp": {}},
    "Volumes": {"/data": {}},
    "StopSignal": "SIGINT",
}


@pytest.fixture(scope="module")
def base_layer(tmp_path_factory) -> bytes:
    require(os.geteuid() == 0, "the layer-cache mounts and builds as root")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")
    root = tmp_path_factory.mktemp("oci-base") / "root"
    make_busybox_base(root, hostname="oci")
    (root / "etc" / "doomed").write_text("deleted by the app layer\n")
    (root / "opt" / "old").mkdir(parents=True)
    (root / "opt" / "old" / "stale").write_text("hidden by an opaque dir\n")
    return layer_of_dir(root)


def app_layer(marker: str) -> bytes:
    """Adds /srv/app, deletes /etc/doomed (a whiteout), makes /opt/old opaque, adds /opt/old/fresh."""
    return layer_of_members([
        entry("srv", tarfile.DIRTYPE), entry("srv/app", tarfile.DIRTYPE),
        file_member("srv/app/marker", marker.encode()),
        entry("etc", tarfile.DIRTYPE), file_member("etc/.wh.doomed", b""),
        entry("opt", tarfile.DIRTYPE), entry("opt/old", tarfile.DIRTYPE),
        file_member("opt/old/.wh..wh..opq", b""), file_member("opt/old/fresh", b"fresh\n"),
    ])


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


async def _store_bytes(fleet) -> dict[str, int]:
    bucket = await fleet.bus.js.object_store(OBJECT_BUCKET)
    try:
        return {o.name: o.size for o in await bucket.list()}
    except Exception as exc:  # nats-py raises NotFoundError for an empty bucket
        if type(exc).__name__ == "NotFoundError":
            return {}
        raise


@pytest.fixture(scope="module")
async def imported(fleet, base_layer, tmp_path_factory):
    layers = Layers(fleet.bus)
    archive = Image([base_layer, app_layer("one")], CONFIG, ["busybox base", "the app"]).oci_archive(
        tmp_path_factory.mktemp("oci-img") / "one.tar")
    name = _name("img")
    reply = await layers.import_image(name, archive)
    yield layers, name, reply
    await layers.remove(name)


async def test_each_oci_layer_becomes_one_erofs_layer_and_the_config_is_recorded(fleet, imported):
    layers, name, reply = imported
    layer = reply.layer
    assert len(layer.stack) == 2 and layer.digest == layer.stack[-1].digest
    assert [p.created_by for p in layer.stack] == ["busybox base", "the app"]
    assert all(p.diff_id.startswith("sha256:") for p in layer.stack)
    stored = await _store_bytes(fleet)
    assert all(stored.get(p.digest) == p.size for p in layer.stack), "every layer is its own image in the store"
    config = layer.config
    assert config is not None and config.working_dir == "/srv/app" and config.cmd == ["default-arg"]
    assert config.labels == {"org.opencontainers.image.title": "oci-test"}
    # What sandfleet does not do is said, not dropped.
    assert {item.split(":")[0] for item in config.not_applied} == {"ExposedPorts", "StopSignal", "Volumes"}
    shown = describe_import(reply)
    assert "not applied: ExposedPorts" in shown and "not applied: Volumes" in shown
    assert (await layers.get(name)).stack == layer.stack


@pytest.mark.parametrize("isolation", ["process", "container"])
async def test_a_sandbox_over_the_image_reads_its_layers_and_config(fleet, imported, isolation):
    if isolation == "container":
        require(shutil.which("crun") is not None, "crun is installed")
    _, name, _ = imported
    sb = await fleet.create(isolation=isolation, memory_mb=128, layers=[name])
    try:
        r = await sb.exec(["sh", "-c", 'echo "$GREETING|$SHARED|$(pwd)"; cat marker; '
                                       'test -e /etc/doomed || echo doomed-gone; ls /opt/old'],
                          env={"SHARED": "request"})
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode().split("\n") == ["from the image|request|/srv/app", "one" + "doomed-gone",
                                                  "fresh", ""]
        # A command naming its own cwd keeps it.
        assert (await sb.exec(["sh", "-c", "pwd"], cwd="/etc")).stdout == b"/etc\n"
        # The image's command: Entrypoint + Cmd, or Entrypoint + the given argv.
        r = await sb.exec(image_command=True)
        assert r.exit_code == 0 and r.stdout == b"entry:from the image:default-arg::/srv/app\n", r
        r = await sb.exec(["given", "two"], image_command=True)
        assert r.stdout == b"entry:from the image:given:two:/srv/app\n"
        streamed: list[bytes] = []
        r = await sb.exec(image_command=True, on_stdout=streamed.append)
        assert b"".join(streamed) == r.stdout == b"entry:from the image:default-arg::/srv/app\n"
        spawned = await sb.spawn(["spawned"], image_command=True)
        argv = (await spawned.info()).argv
        assert argv[:2] == ["/bin/sh", "-c"] and argv[-1] == "spawned"
        await spawned.wait()
        term = await sb.pty(image_command=True)  # on a terminal of its own, as `docker run -it IMAGE`
        screen = b"".join([chunk async for chunk in term.output()])
        assert b"entry:from the image:default-arg::/srv/app" in screen, screen
    finally:
        await sb.destroy()


@pytest.mark.parametrize("isolation", ["process", "container"])
async def test_the_images_user_runs_every_command_by_name_or_number(fleet, base_layer, tmp_path, isolation):
    if isolation == "container":
        require(shutil.which("crun") is not None, "crun is installed")
    accounts = layer_of_members([
        entry("etc", tarfile.DIRTYPE),
        file_member("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:app:/home/app:/bin/sh\n"),
        file_member("etc/group", b"root:x:0:\napp:x:1001:\nstaff:x:50:\n"),
        entry("home", tarfile.DIRTYPE), entry("home/app", tarfile.DIRTYPE, uid=1000, gid=1001, mode=0o755),
        entry("roots", tarfile.DIRTYPE, mode=0o755),  # root's: root may write it (as its owner), app may not
    ])
    layers, made = Layers(fleet.bus), []
    try:
        for user, want in (("app", b"1000 1001"), ("app:staff", b"1000 50"), ("4242", b"4242 0")):
            name = _name("user")
            reply = await layers.import_image(name, Image([base_layer, accounts], {"User": user, "Env": ["PATH=/bin"]}
                                                          ).oci_archive(tmp_path / f"{name}.tar"))
            made.append(name)
            assert not any(item.startswith("User") for item in reply.layer.config.not_applied)
            sb = await fleet.create(isolation=isolation, memory_mb=128, layers=[name])
            try:
                r = await sb.exec(["sh", "-c", 'echo "$(id -u) $(id -g)"; touch /tmp/mine; ls -n /tmp/mine'])
                assert r.exit_code == 0, r.stderr
                lines = r.stdout.split(b"\n")
                assert lines[0] == want and lines[1].split()[2:4] == want.split(), r.stdout
                spawned = await sb.spawn(["sh", "-c", "id -u"])
                await spawned.wait()
                assert b"".join([o.data async for o in spawned.output(follow=False)]).strip() == want.split()[0]
                if user == "app":  # the switch is real: a directory only root may write refuses it
                    denied = await sb.exec(["sh", "-c", "touch /roots/x"])
                    assert denied.exit_code != 0 and b"Permission denied" in denied.stderr, denied
            finally:
                await sb.destroy()
        unknown = _name("user")
        await layers.import_image(unknown, Image([base_layer, accounts], {"User": "nobody-here"}
                                                 ).oci_archive(tmp_path / "unknown.tar"))
        made.append(unknown)
        sb = await fleet.create(isolation=isolation, memory_mb=128, layers=[unknown])
        try:
            with pytest.raises(errors.InvalidRequest, match="no user 'nobody-here'"):
                await sb.exec(["true"])
        finally:
            await sb.destroy()
    finally:
        for name in made:
            await layers.remove(name)


async def test_image_command_on_layers_without_a_config_and_a_missing_argv_are_refused(fleet, imported):
    sb = await fleet.create(host_view=True)
    try:
        with pytest.raises(errors.InvalidRequest, match="no image config"):
            await sb.exec(image_command=True)
        with pytest.raises(errors.InvalidRequest, match="argv is required"):
            await sb.exec()
    finally:
        await sb.destroy()


async def test_two_images_sharing_a_base_share_its_layer_and_its_bytes(fleet, platform, imported, base_layer,
                                                                       tmp_path):
    layers, _, first = imported
    before = await _store_bytes(fleet)
    archive = Image([base_layer, app_layer("two")], CONFIG).oci_archive(tmp_path / "two.tar")
    name = _name("img2")
    second = await layers.import_image(name, archive)
    try:
        assert second.layer.stack[0] == msgspec.structs.replace(first.layer.stack[0], created_by="")
        assert second.reused == [first.layer.stack[0].digest]
        assert second.layer.stack[1].digest != first.layer.stack[1].digest
        added = {k: v for k, v in (await _store_bytes(fleet)).items() if k not in before}
        own = second.layer.stack[1]
        assert set(added) == {own.digest, own.digest + ".chunks"}, "only the image's own layer is stored"
        # And only its own layer was sent: the base's blob stayed out of the upload.
        with tarfile.open(archive) as t:  # the base's blob as the archive holds it (gzip)
            base_blob = t.getmember(f"blobs/sha256/{sha(gzip.compress(base_layer, mtime=0)).split(':')[1]}").size
        assert second.upload_bytes <= archive.stat().st_size - base_blob, (second.upload_bytes, base_blob)
        assert first.upload_bytes > base_blob  # the first import sent it
        # The base is one cached image and one mount on the node for both images' sandboxes.
        a = await fleet.create(layers=[first.layer.name])
        b = await fleet.create(layers=[name])
        try:
            assert (await b.exec(["cat", "/srv/app/marker"])).stdout == b"two"
            cache = await layers.cache(platform.node_id)
            base = [i for i in cache.images if i.digest == first.layer.stack[0].digest]
            assert len(base) == 1 and base[0].mounted and base[0].users >= 2
        finally:
            await a.destroy()
            await b.destroy()
    finally:
        await layers.remove(name)
    assert first.layer.stack[0].digest in await _store_bytes(fleet), "removing one image keeps the shared base"


@pytest.mark.parametrize("form", ["docker-save", "oci-layout-dir"])
async def test_docker_save_archives_and_oci_layout_directories_import_alike(fleet, imported, base_layer, tmp_path,
                                                                            form):
    layers, _, first = imported
    image = Image([base_layer, app_layer("one")], CONFIG, ["busybox base", "the app"])
    if form == "docker-save":
        source = image.docker_save(tmp_path / "saved.tar")
    else:
        source = image.oci_layout(tmp_path / "layout")
    name = _name("img-" + form.split("-")[0])
    reply = await layers.import_image(name, source)
    try:
        assert [p.digest for p in reply.layer.stack] == [p.digest for p in first.layer.stack]
        assert reply.layer.config == first.layer.config
        assert reply.stored is False, "the same layers as an image already imported: nothing new stored"
    finally:
        await layers.remove(name)


async def test_an_archive_lacking_a_layer_the_store_does_not_have_is_refused_and_stores_nothing(fleet, tmp_path):
    """A blob may be left out only where the store has its diff id (what the SDK's copy does)."""
    from sandfleet import oci_archive

    unknown = layer_of_members([file_member("only-here", secrets.token_bytes(64))])
    full = Image([unknown], {"Env": ["PATH=/bin"]}).oci_archive(tmp_path / "full.tar")
    thin = tmp_path / "thin.tar"
    oci_archive.copy_without(full, thin, oci_archive.read_archive(full).layers)
    before = await _store_bytes(fleet)
    bus = fleet.bus
    upload = await Layers(bus)._upload(thin)  # sent as it is: the SDK itself would have sent the blob
    with pytest.raises(errors.InvalidRequest, match="lacks layer .* no layer of its diff id"):
        await Layers(bus)._build(_name("thin"), {"type": "image", "upload": upload, "filename": "thin.tar"},
                                 None, (), "lz4", 120)
    assert await _store_bytes(fleet) == before


async def test_a_registry_reference_is_refused_with_what_to_do_instead(fleet):
    with pytest.raises(errors.Unsupported, match="skopeo copy"):
        await Layers(fleet.bus).import_image("reg", "docker.io/library/debian:12")


async def test_the_cli_imports_and_lists_what_it_did_not_apply(fleet, platform, base_layer, tmp_path):
    archive = Image([base_layer], {"Healthcheck": {"Test": ["CMD", "true"]}, "User": "1000"}).oci_archive(
        tmp_path / "cli.tar")
    name = _name("img-cli")
    out = platform.cli("layer", "import", name, str(archive)).stdout.decode()
    try:
        assert f"{name}  1 layer(s)" in out
        assert "not applied: Healthcheck" in out and "user 1000" in out  # the User is applied, so not listed
        assert "not applied: User" not in out
        listed = platform.cli("layer", "ls", name).stdout.decode()
        assert "(oci, 1 layer(s)" in listed
    finally:
        platform.cli("layer", "rm", name)


# -- Dockerfile builds -------------------------------------------------------------------


async def test_a_dockerfile_build_round_trip(fleet, platform, imported, tmp_path):
    _, name, first = imported
    context = tmp_path / "ctx"
    (context / "src").mkdir(parents=True)
    (context / "src" / "hello.txt").write_text("copied\n")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"""\
# a comment
ARG WHO=builder
FROM {name}
ENV STAGE=built \\
    WHO2=${{WHO}}
WORKDIR /work
COPY src/hello.txt ./hello.txt
RUN echo "ran as $WHO in $(pwd)" > ran.txt && \\
    rm /srv/app/marker
LABEL stage=two
ENTRYPOINT ["/bin/sh", "-c"]
CMD ["cat /work/ran.txt /work/hello.txt; echo $STAGE"]
""")
    built = _name("df")
    out = platform.cli("layer", "build", built, "--dockerfile", str(dockerfile), "--context", str(context),
                       timeout=300, check=False)
    try:
        assert out.returncode == 0, out.stderr.decode()
        layer = await Layers(fleet.bus).get(built)
        assert [p.digest for p in layer.stack[:2]] == [p.digest for p in first.layer.stack]
        assert len(layer.stack) > 2 and layer.config is not None
        assert layer.config.labels["stage"] == "two" and layer.config.working_dir == "/work"
        sb = await fleet.create(layers=[built])
        try:
            r = await sb.exec(image_command=True)
            assert r.stdout == b"ran as builder in /work\ncopied\nbuilt\n", (r, out.stdout)
            assert (await sb.exec(["test", "-e", "/srv/app/marker"])).exit_code == 1
        finally:
            await sb.destroy()
    finally:
        platform.cli("layer", "rm", built, check=False)


async def test_a_dockerfile_instruction_it_cannot_build_is_refused_naming_its_line(fleet, platform, imported,
                                                                                   tmp_path):
    _, name, _ = imported
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {name}\nRUN true\nCOPY --from=stage /a /b\n")
    before = {layer.name for layer in await Layers(fleet.bus).list()}
    proc = platform.cli("layer", "build", _name("df-bad"), "--dockerfile", str(dockerfile), check=False)
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and "line 3" in stderr and "--from=stage" in stderr, stderr
    assert "Traceback" not in stderr
    assert {layer.name for layer in await Layers(fleet.bus).list()} == before


async def test_a_failing_run_step_leaves_no_layer_behind(fleet, platform, imported, tmp_path):
    _, name, _ = imported
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {name}\nRUN echo one > /srv/one\nRUN echo failing >&2; exit 7\n")
    before = {layer.name for layer in await Layers(fleet.bus).list()}
    proc = platform.cli("layer", "build", _name("df-fail"), "--dockerfile", str(dockerfile), check=False,
                        timeout=300)
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and "line 3: RUN exited 7: failing" in stderr, stderr
    assert {layer.name for layer in await Layers(fleet.bus).list()} == before, "the steps' layers are removed"


# -- the Dockerfile parser and plan, without a platform ------------------------------------


def test_the_parser_joins_continuations_skips_comments_and_numbers_lines():
    found = dockerfile.parse("# c\n\nFROM base\nRUN a \\\n  # inside\n  b\nenv K=V\n")
    assert [(i.line, i.keyword, i.text) for i in found] == [(3, "FROM", "base"), (4, "RUN", "a b"),
                                                           (7, "ENV", "K=V")]


@pytest.mark.parametrize("text, line, what", [
    ("FROM a\nFROM b\n", 2, "second FROM"),
    ("FROM a\nCOPY --from=x f /x\n", 2, "--from"),
    ("RUN x\nFROM a\n", 1, "only ARG"),
    ("FROM a\nCOPY ../secret /x\n", 2, "outside the build context"),
    ("FROM a\nRUN --mount=type=cache,target=/c true\n", 2, "RUN flags"),
    ("FROM a\nADD https://example.com/f /x\n", 2, "URL"),
    ("FROM scratch\n", 1, "scratch"),
])
def test_what_the_builder_does_not_take_is_refused_naming_the_line(tmp_path, text, line, what):
    (tmp_path / "f").write_text("x")
    with pytest.raises(dockerfile.DockerfileError, match=f"line {line}: .*{what}"):
        dockerfile.plan(dockerfile.parse(text), tmp_path)


def test_a_symlink_in_the_context_cannot_reach_out_of_it(tmp_path):
    (tmp_path / "ctx").mkdir()
    os.symlink("/etc", tmp_path / "ctx" / "out")
    with pytest.raises(dockerfile.DockerfileError, match="line 2: out/hostname is outside the build context"):
        dockerfile.plan(dockerfile.parse("FROM a\nCOPY out/hostname /x\n"), tmp_path / "ctx")


def test_the_plan_carries_the_base_config_args_env_and_docker_s_entrypoint_rule(tmp_path):
    base = ImageConfig(env=["PATH=/bin", "A=base"], working_dir="/srv", cmd=["base-cmd"], labels={"l": "1"})
    text = ("ARG V=1\nFROM img:${V}\nARG B=arg-b\nENV A=${A}-more C=\"x y\"\nWORKDIR app\n"
            "RUN echo $B\nENTRYPOINT [\"/bin/sh\"]\nUSER app\n")
    planned = dockerfile.plan(dockerfile.parse(text), tmp_path, base, {"B": "given"})
    assert planned.base == "img:1"
    assert planned.config.env == ["PATH=/bin", "A=base-more", "C=x y"]
    assert planned.config.working_dir == "/srv/app" and planned.config.labels == {"l": "1"}
    assert planned.config.entrypoint == ["/bin/sh"] and planned.config.cmd == [], "a new ENTRYPOINT drops the CMD"
    assert planned.config.user == "app" and not any(n.startswith("User") for n in planned.config.not_applied)
    run = planned.steps[-1]
    assert isinstance(run, dockerfile.Run) and run.env["B"] == "given" and run.cwd == "/srv/app"


async def test_push_copies_an_image_with_every_layer_of_its_stack(fleet, imported, tmp_path):
    """Another cluster's store (a bare nats-server) gets every layer, and the stack pulls back."""
    from sandfleet.config import free_port
    from sandfleet.supervisor import nats_server_binary

    layers, name, first = imported
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
                             str(tmp_path / "other")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"nats://127.0.0.1:{port}"
        pushed = await layers.push(name, url)
        assert pushed.copied + pushed.present == [p.digest for p in first.layer.stack]
        assert pushed.layer.stack == first.layer.stack and pushed.layer.config == first.layer.config
        other = await nats.connect(url)
        try:  # the OCI layers map to the same images there, so an import there reuses them
            diffs = await other.jetstream().key_value(DIFF_BUCKET)
            for part in first.layer.stack:
                mapped = msgspec.json.decode((await diffs.get(part.diff_id.removeprefix("sha256:"))).value,
                                             type=StackLayer)
                assert (mapped.digest, mapped.diff_id) == (part.digest, part.diff_id)
        finally:
            await other.close()
        await layers.remove(name)  # gone here with its images; the fixture's teardown finds it pulled back
        pulled = await layers.pull(name, url)
        assert pulled.layer.stack == first.layer.stack and len(pulled.copied) == len(first.layer.stack)
        sb = await fleet.create(layers=[name])
        try:
            assert (await sb.exec(["cat", "/srv/app/marker"])).stdout == b"one"
        finally:
            await sb.destroy()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_launcher_puts_the_image_config_under_each_command():
    from schemas.layers import Rootfs
    from services.launcher import image_config

    config = ImageConfig(env=["A=image", "B=image", "broken"], working_dir="/srv", entrypoint=["/e"], cmd=["c"])
    root = Rootfs(sandbox_id="s", path="/r", upper="/u", layers=[], config=config)
    assert image_config.resolve(root, ["x"], {"B": "mine"}, "/workspace", False) == (
        ["x"], {"A": "image", "B": "mine"}, "/srv")
    assert image_config.resolve(root, ["x"], {}, "/tmp", False)[2] == "/tmp"
    assert image_config.resolve(root, None, {}, "/workspace", True)[0] == ["/e", "c"]
    assert image_config.resolve(root, ["y"], {}, "/workspace", True)[0] == ["/e", "y"]
    assert image_config.resolve(None, ["x"], {}, "/workspace", False) == (["x"], {}, "/workspace")
    with pytest.raises(errors.ServiceError):
        image_config.resolve(None, None, {}, "/workspace", True)


def test_a_layer_twice_in_an_image_is_kept_where_it_is_highest():
    from schemas.layers import StackLayer
    from services.layer_cache.importing import upper_copies

    a, b = StackLayer(digest="sha256:a", size=1), StackLayer(digest="sha256:b", size=1)
    assert upper_copies([a, b, a]) == [b, a] and upper_copies([a, b]) == [a, b]


async def test_a_dockerfile_from_an_image_archive_imports_it_first(fleet, platform, base_layer, tmp_path):
    context = tmp_path / "ctx"
    context.mkdir()
    Image([base_layer], {"Env": ["FROM_ARCHIVE=yes"]}).oci_archive(context / "base.tar")
    (context / "note").write_text("noted\n")
    (context / "Dockerfile").write_text("FROM base.tar\nCOPY note /etc/note\nCMD [\"cat\", \"/etc/note\"]\n")
    built = _name("df-arch")
    out = platform.cli("layer", "build", built, "--dockerfile", str(context / "Dockerfile"), check=False, timeout=300)
    try:
        assert out.returncode == 0, out.stderr.decode()
        assert "importing the archive" in out.stderr.decode()
        layer = await Layers(fleet.bus).get(built)
        assert layer.config is not None and "FROM_ARCHIVE=yes" in layer.config.env
        sb = await fleet.create(layers=[built])
        try:
            assert (await sb.exec(image_command=True)).stdout == b"noted\n"
        finally:
            await sb.destroy()
        names = {entry.name for entry in await Layers(fleet.bus).list()}
        assert not [n for n in names if n.startswith(built[:40] + "-")], "the build's own names are gone"
    finally:
        platform.cli("layer", "rm", built, check=False)


async def test_the_same_layer_with_whiteouts_gives_the_same_image_every_time(fleet, tmp_path):
    """Built twice (the diff-id map emptied between: a store that never saw it), one digest."""
    layers = Layers(fleet.bus)
    layer = app_layer("same")
    digests = []
    for i in range(2):
        kv = await fleet.bus.js.key_value(DIFF_BUCKET)
        await kv.delete(sha(layer).removeprefix("sha256:"))  # not purge: its rollup header is refused by the bucket
        name = _name(f"img-same{i}")
        reply = await layers.import_image(name, Image([layer]).oci_archive(tmp_path / f"{i}.tar"))
        digests.append(reply.layer.digest)
        assert reply.reused == []
        await layers.remove(name)
    assert digests[0] == digests[1]


async def test_an_image_of_sixty_layers_composes_past_mount_s_one_page_of_options(fleet, base_layer, tmp_path):
    """Sixty lower layers of long paths are more than mount(2)'s one page of options can name:
    the overlay takes them one `lowerdir+` at a time, and every layer reads through it."""
    deep = [layer_of_members([entry("deep", tarfile.DIRTYPE), file_member(f"deep/{i:02d}", f"layer {i}\n".encode())])
            for i in range(59)]
    archive = Image([base_layer, *deep], {"Env": ["PATH=/bin"]}, ["base", *(f"deep {i}" for i in range(59))]
                    ).oci_archive(tmp_path / "deep.tar")
    layers, name = Layers(fleet.bus), _name("deep")
    reply = await layers.import_image(name, archive)
    try:
        assert len(reply.layer.stack) == 60
        sb = await fleet.create(memory_mb=128, layers=[name])
        try:
            r = await sb.exec(["sh", "-c", "ls /deep | wc -l; cat /deep/00 /deep/58; cat /etc/hostname"])
            assert r.exit_code == 0, r.stderr
            assert r.stdout == b"59\nlayer 0\nlayer 58\noci\n"
        finally:
            await sb.destroy()
    finally:
        await layers.remove(name)
