"""The Python 3.13 trees of tests/trixie_python.py: a new build removes older keys' trees, never one
a run holds."""

import fcntl

import pytest

from tests import trixie_python


def _tree(cache, key):
    (cache / key).mkdir()
    (cache / key / ".complete").write_text("{}")
    (cache / f".{key}.lock").touch()


def test_a_new_tree_removes_older_keys_trees_but_not_one_a_run_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(trixie_python, "CACHE", tmp_path)
    for key in ("old", "running", "new"):
        _tree(tmp_path, key)
    (tmp_path / "debs").mkdir()
    with open(tmp_path / ".running.lock", "a") as run:
        fcntl.flock(run, fcntl.LOCK_SH)  # what Tree.run holds
        trixie_python._prune(keep="new", log=lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new.lock", ".running.lock", "debs", "new", "running"]


def test_a_run_in_a_pruned_tree_is_a_typed_error(tmp_path):
    (tmp_path / "gone").mkdir()
    with pytest.raises(trixie_python.TreeBuildError, match="pruned"):
        trixie_python.Tree(tmp_path / "gone").run(["true"])
