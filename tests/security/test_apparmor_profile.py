"""AppArmor profiles generated per sandbox, validated by the real `apparmor_parser` offline
(this kernel has no AppArmor, so loading them is not exercised here), and the agent's report."""

from __future__ import annotations

import os

import pytest

from agents.node import apparmor
from tests.kernel import active_lsms, only_where, require


@pytest.fixture(autouse=True)
def parser():
    require(apparmor.parser_path() is not None, "apparmor_parser (Debian package apparmor) is installed")


def test_a_generated_profile_compiles_with_apparmor_parser():
    text = apparmor.profile("sb-0123456789ab", ["tmp", "workspace", "var", "home"])
    apparmor.validate(text)
    assert "profile sandfleet-sb-0123456789ab " in text


def test_the_profile_carries_the_landlock_policy_and_the_denials_landlock_cannot_express(tmp_path):
    for name in ("usr", "bin", "etc", "workspace", "tmp", "app", "proc", "dev"):
        (tmp_path / name).mkdir()
    os.symlink("usr/lib", tmp_path / "lib")
    writable = apparmor.writable_dirs(str(tmp_path))
    assert writable == ["app", "tmp", "workspace"]  # system content, /proc, /dev and links are not
    text = apparmor.profile("sb-x", writable)
    apparmor.validate(text)
    assert "  /{app,tmp,workspace}/** rwlkmix," in text and "  /** mrix," in text
    assert "deny /proc/{kpagecgroup," in text and "deny capability," in text and "deny network raw," in text
    assert "deny mount," in text and "deny ptrace," in text


def test_the_host_view_sandbox_writes_only_tmp_and_workspace():
    assert apparmor.writable_dirs(None) == ["tmp", "workspace"]


def test_a_broken_profile_is_refused_with_the_parsers_words():
    text = apparmor.profile("sb-x", ["tmp"]).replace("deny ptrace,", "deny ptrace-everything,")
    with pytest.raises(apparmor.ProfileError, match="parser error|syntax error"):
        apparmor.validate(text)


@pytest.mark.parametrize("name", ["", "a/b", "x y", "a,b", "}"])
def test_a_directory_name_that_would_change_the_profile_is_refused(name):
    with pytest.raises(apparmor.ProfileError):
        apparmor.profile("sb-x", [name])


def test_a_kernel_without_apparmor_is_reported_off():
    only_where("apparmor" not in active_lsms(), "the kernel runs AppArmor")
    assert apparmor.node_status() == ("off: not in this kernel (profiles are generated and validated offline "
                                      "with apparmor_parser)")


def test_a_kernel_running_apparmor_gets_a_profile_per_sandbox_reported_on(monkeypatch):
    """This kernel has no AppArmor, so the other case is taken from the node's one kernel probe;
    the profiles it reports on are still compiled by the real apparmor_parser."""
    monkeypatch.setattr(apparmor.lsm, "apparmor_enabled", lambda: True)
    profiles = apparmor.SandboxProfiles.detect()
    assert profiles.on
    assert apparmor.node_status() == ("on: one profile per sandbox, loaded when it is confined and removed "
                                      "when it is released")


def test_where_apparmor_is_off_no_profile_is_loaded_and_none_is_named():
    only_where("apparmor" not in active_lsms(), "the kernel runs AppArmor")
    profiles = apparmor.SandboxProfiles.detect()
    assert not profiles.on and profiles.held() == set()
    assert profiles.load("sb-x", host_view=False) == ""
    profiles.unload("sb-x")  # nothing to remove, nothing raised


def test_loading_on_a_kernel_without_apparmor_is_refused_with_the_parsers_words(monkeypatch):
    """What a node whose kernel probe lied would see: the real parser refuses to load."""
    only_where("apparmor" not in active_lsms(), "the kernel runs AppArmor")
    monkeypatch.setattr(apparmor.lsm, "apparmor_enabled", lambda: True)
    with pytest.raises(apparmor.ProfileError, match="suitable fs|apparmor"):
        apparmor.SandboxProfiles.detect().load("sb-x", host_view=False)


def test_a_root_of_layers_gets_every_top_level_directory_but_system_content_and_dev():
    """Loaded before the root is composed (confine and compose run at once), so the profile
    cannot list the root's directories: it grants all but the system ones, as Landlock does."""
    text = apparmor.profile("sb-x", None)
    apparmor.validate(text)
    grant = next(line.strip() for line in text.splitlines() if line.strip().endswith("/** rwlkmix,"))
    names = grant.removeprefix("/{").removesuffix("}/** rwlkmix,").split(",")
    import fnmatch
    def granted(name: str) -> bool:  # AppArmor's [^x] is fnmatch's [!x]
        return any(fnmatch.fnmatchcase(name, n.replace("[^", "[!")) for n in names)
    assert all(granted(n) for n in ("workspace", "tmp", "home", "d", "de", "devx", "data", "deb", "root"))
    assert not granted("dev")
    assert "  deny /* wl," in text  # nothing made at the top level
    denied = next(line for line in text.splitlines() if line.startswith("  deny /{bin,"))
    assert all(d in denied for d in ("usr", "etc", "bin", "lib", "proc", "sys"))
    assert "  /dev/pts/* rw," in text  # a terminal's slave, passed in by the launcher


def test_a_container_runs_its_init_under_the_profile_the_agent_named():
    from linuxnode.container import ContainerSpec, bundle_config
    spec = ContainerSpec(sandbox_id="sb-x", rootfs="/r", cgroup_procs=[], netns="/n")
    assert "apparmorProfile" not in bundle_config(spec)["process"]
    named = ContainerSpec(sandbox_id="sb-x", rootfs="/r", cgroup_procs=[], netns="/n",
                          apparmor_profile=apparmor.profile_name("sb-x"))
    assert bundle_config(named)["process"]["apparmorProfile"] == "sandfleet-sb-x"


def test_without_the_parser_the_node_says_why(monkeypatch):
    monkeypatch.setattr(apparmor, "parser_path", lambda: None)
    assert "apparmor_parser is not installed" in apparmor.node_status()



def test_a_build_sandbox_may_write_its_whole_root_with_a_builds_capabilities_and_no_other():
    """A Dockerfile RUN's sandbox (SandboxSpec.build): Landlock and the exec helper let it write
    system content and keep a package manager's capabilities; its profile must say the same,
    or on an AppArmor host every `apt-get install` of a build would be refused."""
    text = apparmor.profile("sb-x", None, build=True)
    apparmor.validate(text)
    assert "  /** rwlkmix," in text
    assert "deny /* wl," not in text and "deny /{bin," not in text
    assert "deny capability," not in text
    granted = {line.strip().removeprefix("capability ").rstrip(",") for line in text.splitlines()
               if line.strip().startswith("capability ")}
    assert granted == {"chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid"}
    assert "deny /sys/** wkl," in text and "deny mount," in text and "deny ptrace," in text
    ordinary = apparmor.profile("sb-x", None)
    assert "deny capability," in ordinary and "  capability chown," not in ordinary
