"""The step channel's choice of local path, by measurement: a broadcast of ``--bytes``
to N processes with an 8-byte answer from each, over a Unix stream socket per process
(what ``transport/unix_link.py`` uses) and over ZMQ IPC (ROUTER/DEALER, what the channel
used before), rounds alternating. Prints the median round trip and the CPU every process
together burnt per round trip, with the machine and its load.

    .venv/bin/python scripts/bench_links.py [--procs 2 4] [--trips 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import socket
import statistics
import tempfile
import time

import zmq


def cpu_s() -> float:
    """CPU seconds of this process and its waited-for children so far."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    return sock.recv(n, socket.MSG_WAITALL)


def unix_trips(procs: int, trips: int, payload: bytes) -> tuple[list[float], float]:
    path = os.path.join(tempfile.mkdtemp(), "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(procs)
    pids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:  # the answering process
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(path)
            while (head := _recv_exact(c, 8)) and len(head) == 8:
                _recv_exact(c, int.from_bytes(head, "little"))
                c.sendall((8).to_bytes(8, "little") + b"answered")
            os._exit(0)
        pids.append(pid)
    conns = [srv.accept()[0] for _ in range(procs)]
    msg = len(payload).to_bytes(8, "little") + payload
    lat = []
    c0 = cpu_s()
    for _ in range(trips):
        t = time.perf_counter()
        for c in conns:
            c.sendall(msg)
        for c in conns:
            _recv_exact(c, int.from_bytes(_recv_exact(c, 8), "little"))
        lat.append(time.perf_counter() - t)
    for c in conns:
        c.close()
    for pid in pids:
        os.waitpid(pid, 0)
    srv.close()
    return lat, cpu_s() - c0


def zmq_trips(procs: int, trips: int, payload: bytes) -> tuple[list[float], float]:
    endpoint = "ipc://" + os.path.join(tempfile.mkdtemp(), "z")
    pids = []
    for i in range(procs):
        pid = os.fork()
        if pid == 0:
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, b"r%d" % i)
            s.connect(endpoint)
            s.send(b"hello")
            while s.recv() != b"stop":
                s.send(b"answered")
            s.close(0)
            ctx.term()
            os._exit(0)
        pids.append(pid)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    ids = [router.recv_multipart()[0] for _ in range(procs)]
    lat = []
    c0 = cpu_s()
    for _ in range(trips):
        t = time.perf_counter()
        for i in ids:
            router.send_multipart([i, payload])
        for _ in ids:
            router.recv_multipart()
        lat.append(time.perf_counter() - t)
    for i in ids:
        router.send_multipart([i, b"stop"])
    for pid in pids:
        os.waitpid(pid, 0)
    router.close(0)
    ctx.term()
    return lat, cpu_s() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--trips", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bytes", type=int, default=200)
    args = ap.parse_args()
    payload = os.urandom(args.bytes)
    print(f"links on {platform.node()}: {os.cpu_count()} cpus, load {os.getloadavg()}")
    print("procs  path  round trip us (median of round medians)  cpu us per trip")
    for procs in args.procs:
        got: dict[str, tuple[list[float], list[float]]] = {"unix": ([], []), "zmq": ([], [])}
        for _ in range(args.rounds):
            for name, fn in (("unix", unix_trips), ("zmq", zmq_trips)):
                lat, cpu = fn(procs, args.trips, payload)
                got[name][0].append(statistics.median(lat))
                got[name][1].append(cpu / args.trips)
        for name, (lat, cpu) in got.items():
            rt, c = statistics.median(lat) * 1e6, statistics.median(cpu) * 1e6
            print(f"{procs:>5} {name:>5} {rt:>10.0f} {c:>38.0f}")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
