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


def test_a_kernel_running_apparmor_is_reported_available(monkeypatch):
    """This kernel has no AppArmor, so the other case is taken from the node's one kernel probe;
    the profile it reports on is still compiled by the real apparmor_parser."""
    monkeypatch.setattr(apparmor.lsm, "apparmor_enabled", lambda: True)
    assert apparmor.node_status() == ("available: profiles generated and validated; loading them per sandbox "
                                      "is not wired yet")


def test_without_the_parser_the_node_says_why(monkeypatch):
    monkeypatch.setattr(apparmor, "parser_path", lambda: None)
    assert "apparmor_parser is not installed" in apparmor.node_status()

