"""One exception root: every exception class tpcache defines is a ``TpcacheError``, and
keeps the builtin base its callers catch."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import subprocess
import sys

import tpcache
from tpcache.cache.errors import UnknownRequest
from tpcache.errors import TpcacheError


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(tpcache.__path__, "tpcache."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                found.append(obj)
    return found


def test_every_tpcache_exception_is_a_tpcache_error() -> None:
    classes = _exception_classes()
    assert len(classes) > 40  # the walk found the modules
    outside = [
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, TpcacheError)
    ]
    assert outside == []


def test_the_root_is_at_the_package_top_and_bases_stay() -> None:
    assert tpcache.TpcacheError is TpcacheError
    assert issubclass(UnknownRequest, KeyError)
    with_value_error = [c for c in _exception_classes() if issubclass(c, ValueError)]
    assert len(with_value_error) > 10


def test_the_client_and_the_root_import_without_torch_or_ray() -> None:
    code = (
        "import sys, tpcache.client, tpcache.errors; "
        "print('torch' in sys.modules, 'ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _plain(value: object) -> object:
    """``value`` with exceptions (equal only to themselves) as their type and args."""
    if isinstance(value, BaseException):
        return (type(value), value.args)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _same(a: BaseException, b: BaseException) -> bool:
    fields = {k: _plain(v) for k, v in vars(a).items()}
    return (
        type(a) is type(b)
        and str(a) == str(b)
        and a.args == b.args
        and fields == {k: _plain(v) for k, v in vars(b).items()}
    )


def test_errors_with_their_own_constructors_pickle_whole() -> None:
    """Errors cross Ray and the step channel pickled. Python's own pickling rebuilds an
    exception as ``cls(*args)``, which broke every class whose constructor takes other
    arguments than its message (each of these raised TypeError on ``loads``)."""
    from tpcache.coordinator.step_types import RankCallError
    from tpcache.events.event_config import EventConfigError
    from tpcache.frontend.service import AlreadyServing
    from tpcache.transport.channel import RankErrors
    from tpcache.transport.channel_msgs import ChannelConnectError, ChannelError

    cause = ValueError("bad op")
    errors: list[BaseException] = [
        RankCallError(1, cause, dead=True),
        ChannelError(3, "is gone (its process died)", dead=True),
        ChannelConnectError(2, "unix:///tmp/x", "FileNotFoundError: no such file"),
        AlreadyServing("tpcache", "ns", "alive"),
        EventConfigError("endpoint", "must be a str, got int"),
        RankErrors([(0, cause), (1, KeyError(7))]),
    ]
    for err in errors:
        back = pickle.loads(pickle.dumps(err))
        assert _same(back, err), (err, back)
    call = pickle.loads(pickle.dumps(errors[0]))
    assert (call.rank, call.dead, type(call.cause), str(call.cause)) == (
        1,
        True,
        ValueError,
        "bad op",
    )


def test_every_buildable_tpcache_error_round_trips() -> None:
    """Each class whose constructor takes one message (most of them) and each lockstep
    error (step, detail) comes back equal from pickle, OSError-based ones included."""
    from tpcache.lockstep.errors import DivergenceError, RankFailure
    from tpcache.trace import TraceNotFound

    done = 0
    for cls in _exception_classes():
        try:
            err = cls("what went wrong")
        except Exception:  # a constructor of its own: the test above has those
            continue
        assert _same(pickle.loads(pickle.dumps(err)), err), cls
        done += 1
    assert done > 30
    for err in (
        RankFailure(4, "rank 1 failed at op 2", local=True),
        DivergenceError(9, "digests differ", odd_ranks=(1,)),
        TraceNotFound("no trace at /x"),
    ):
        assert _same(pickle.loads(pickle.dumps(err)), err), err
