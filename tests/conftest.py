"""Shared fixtures. One Ray cluster per test session (starting one costs seconds)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the whole session, its files under a temp dir of its own."""
    import ray

    # Unix socket paths must stay short: a short temp dir, not pytest's long tmp_path.
    tmp = tempfile.mkdtemp(prefix="tpr", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
