"""Fixtures for every tier."""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import settings

from tests.helpers import artifacts

# Property tests draw the same examples on every run (deterministic seeds, as every other test): a run that
# finds a new counterexample by chance is a flake, not a finding; a finding becomes an @example.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


@pytest.fixture(autouse=True, scope="session")
def _one_corpus_cache(tmp_path_factory):
    """Every peer and test of the session maps one prepared corpus (dilocox_p2p/corpus_cache.py), built by
    the first that needs it, in the session's temporary directory rather than the user's cache."""
    previous = os.environ.get("DILOCOX_CACHE_DIR")
    os.environ["DILOCOX_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if previous is None:
        os.environ.pop("DILOCOX_CACHE_DIR", None)
    else:
        os.environ["DILOCOX_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """CLI entry points called in-process (`main(argv)`) rebind the root logger to the test's stderr: put it back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """A failed test's peers' logs and records go to the artifacts directory (tests/helpers/artifacts.py), copied
    while its temporary directory is still there."""
    report = yield
    source = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and source is not None:
        kept = artifacts.keep(item.nodeid, source)
        if kept is not None:
            _kept.append(f"{item.nodeid}: {kept}")
    return report


_kept: list[str] = []


def pytest_sessionstart(session):
    """The artifacts of an earlier session are not this one's: start with none (tests/helpers/artifacts.py)."""
    artifacts.clear()


def pytest_terminal_summary(terminalreporter):
    if _kept:
        terminalreporter.section("logs and records of failed tests")
        for line in _kept:
            terminalreporter.write_line(line)
