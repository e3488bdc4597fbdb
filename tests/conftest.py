"""Shared fixtures. One Ray cluster per test session (starting one costs seconds).

The tests mirror the package (tests/cache/, tests/coordinator/, ...); their shared
helpers (a test rank worker, small group configs, wire decoders) are in tests/support/,
put on the path here, and in PYTHONPATH for what the tests start (Ray workers, torchrun,
subprocesses), which import the test worker by name.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

SUPPORT = str(Path(__file__).resolve().parent / "support")
sys.path.insert(0, SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")]))


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Destroy, with linger 0, any ZMQ context a test left open. Garbage collection at
    exit would otherwise terminate it with each socket's own linger, and a socket with
    unsent messages to a peer that is gone can block that forever (a full run here once
    hung so after its last test)."""
    import gc

    import zmq
    from zmq.utils.garbage import gc as zmq_gc

    for obj in gc.get_objects():
        # type(), not isinstance(): some objects warn when their __class__ is read.
        if issubclass(type(obj), zmq.Context) and not obj.closed and obj is not zmq_gc._context:
            obj.destroy(linger=0)
