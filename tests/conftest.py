"""Shared test set-up: Hypothesis profiles, the torch-version marker, shared fixtures.

Profiles: `dev` (the default: random examples, a new draw each run) and `ci` (derandomized, so
a CI failure reproduces; chosen when CI is set, or with HYPOTHESIS_PROFILE=ci). `long`
(HYPOTHESIS_PROFILE=long) runs every property test with HYPOTHESIS_LONG_EXAMPLES examples
(default 2,000), over the tests' own max_examples: the check that a tolerance is a bound over
the whole space the strategies draw, not over the few draws a run makes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
LONG_EXAMPLES = int(os.environ.get("HYPOTHESIS_LONG_EXAMPLES", "2000"))
settings.register_profile("long", deadline=None, max_examples=LONG_EXAMPLES, database=None,
                          suppress_health_check=list(HealthCheck))
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
settings.load_profile(PROFILE)

# The exact step-peak numbers (MemTracker over the allocator's live storages) were measured on
# PyTorch 2.13 (CPU build); other releases allocate temporaries differently.
GOLDEN_TORCH = "2.13"


def _torch_version() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch.__version__


def _long_run(items) -> None:
    """Under the `long` profile, a test's own @settings (which outrank a profile) get its
    example count."""
    for item in items:
        fn = getattr(item, "obj", None)
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is not None:
            fn._hypothesis_internal_use_settings = settings(
                own, max_examples=LONG_EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


def pytest_collection_modifyitems(config, items):
    if PROFILE == "long":
        _long_run(items)
    version = None
    for item in items:
        if item.get_closest_marker("requires_torch_213") is None:
            continue
        version = version or _torch_version() or "none"
        if not version.startswith(GOLDEN_TORCH + "."):
            item.add_marker(pytest.mark.skip(
                reason=f"golden allocator numbers were measured on torch {GOLDEN_TORCH}; "
                       f"this is torch {version}"))


@pytest.fixture(scope="session")
def debug_report(tmp_path_factory):
    """One `gptcalc report` of the debug preset (B=2, S=16) on CPU, built once per session."""
    import torch

    from gptcalc import Workload, from_name
    from reports.report import build_report

    torch.set_num_threads(1)
    return build_report(from_name("debug"), Workload(2, 16), tmp_path_factory.mktemp("report"),
                        device="cpu", name="debug", progress=False)
