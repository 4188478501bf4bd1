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
    while its temporary directory is still there; the report names where (read by the process that prints the
    summary: this one, or pytest-xdist's controller)."""
    report = yield
    source = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and source is not None:
        kept = artifacts.keep(item.nodeid, source)
        if kept is not None:
            report.user_properties.append(("artifacts", str(kept)))
    return report


_kept: list[str] = []


def pytest_runtest_logreport(report):
    _kept.extend(f"{report.nodeid}: {value}" for name, value in report.user_properties if name == "artifacts")


def pytest_sessionstart(session):
    """The artifacts of an earlier session are not this one's: start with none (tests/helpers/artifacts.py).
    Under pytest-xdist the controller clears them before its workers start, and they do not."""
    if not hasattr(session.config, "workerinput"):
        artifacts.clear()


def pytest_terminal_summary(terminalreporter):
    if _kept:
        terminalreporter.section("logs and records of failed tests")
        for line in _kept:
            terminalreporter.write_line(line)


TIERS = ("unit", "swarm", "netns", "docker", "gpu")


def pytest_collection_modifyitems(config, items):
    """Every test belongs to a tier: the test command selects tiers (`-m "unit or swarm"`, then `-m "netns or
    docker"`), and a test of none would never run there. The gpu tier is skipped, with the reason, where this
    machine has fewer CUDA devices than a test needs (`gpu_count`): CI never needs a GPU."""
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {', '.join(untiered[:10])}")
    _skip_without_gpus(items)
    items[:] = spread_swarm_tests(items)


def _skip_without_gpus(items: list) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in gpu_items:
        marker = item.get_closest_marker("gpu_count")
        need = marker.args[0] if marker else 1
        if visible < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), this machine has {visible}"))


# tests this long must not be the last ones a worker starts (30-46 s each on 2 cores beside another test)
LONGEST_FIRST = ("test_a_peer_frozen_for_two_rounds", "killed_mid_round_and_resumed", "matchmaking_fails_after",
                 "sign_flipped_contributions", "bit_flipped_message")


def spread_swarm_tests(items: list) -> list:
    """The swarm tests spread evenly among the others, the longest (LONGEST_FIRST) first. pytest-xdist's `load` scheduler hands each
    worker a run of consecutive tests to start with (a quarter of its share): in collection order that put all 65
    swarm tests on one worker, which ran them one after the other (about 650 s) while the other finished the unit
    tests in 3 minutes and sat idle. Spread out, both workers run swarm tests, and each swarm test mostly shares the
    machine with unit tests. The same order on every worker (xdist requires it) and without xdist."""
    swarm = [i for i in items if i.get_closest_marker("swarm")]
    rest = [i for i in items if not i.get_closest_marker("swarm")]
    if not swarm or not rest:
        return items
    swarm.sort(key=lambda i: not any(name in i.nodeid for name in LONGEST_FIRST))  # stable: otherwise as collected
    out, step = [], len(rest) / len(swarm)
    for k, test in enumerate(swarm):
        out.append(test)
        out.extend(rest[round(k * step) : round((k + 1) * step)])
    return out
