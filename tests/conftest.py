"""Fixtures for every tier."""

from __future__ import annotations

import logging
import os

import pytest


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
