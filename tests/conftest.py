"""Shared fixtures and hypothesis settings."""

from __future__ import annotations

import os

import pytest
import vllm_background
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    parent=settings.get_profile("default"),
    database=None,
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The real-vLLM tier's long jobs start as soon as a test that reads them is
    selected, to run beside the rest of the suite (tests/vllm_background.py)."""
    if not session.config.option.collectonly:
        vllm_background.start({item.path.name for item in session.items})


def pytest_sessionfinish(session: pytest.Session) -> None:
    vllm_background.close()
