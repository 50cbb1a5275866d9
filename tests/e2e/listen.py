#!/usr/bin/python3
"""Ports for the e2e tests, owned instead of guessed (README "Socket activation and --listen-fd").

  listen.py reserve N FILE        binds N sockets on 127.0.0.1 port 0 (the kernel picks free ports),
                                  writes "127.0.0.1:P1,127.0.0.1:P2,..." to FILE (atomically), and
                                  holds them until the process that started it exits (or SIGTERM).
  listen.py reserve-shared HOSTS FILE
                                  one port reserved on every IP of the comma-separated HOSTS
                                  (shards on several "nodes"), written to FILE; held as above.
  listen.py serve [--host IP] [--systemd] PORT -- CMD...
                                  binds a socket listening on IP:PORT (IP: 127.0.0.1) and runs CMD
                                  (exec: same PID) with it as descriptor 3: `psd ... --listen-fd 3`,
                                  or, with --systemd, announced as systemd does it (LISTEN_FDS=1,
                                  LISTEN_PID=the PID), for a command that execs psd in the end.

Why two sockets per port: a reserved socket is bound but not listening. It keeps the port the
test's for the whole test — across shard restarts, where a psd's own bind would race with every
other process on the machine — yet a connection to a shard that is down is refused at once, as in
production, instead of waiting in the backlog of a listening socket nobody accepts on. Both sockets
set SO_REUSEPORT, which lets a process of the same user bind the reserved port (and nobody else);
`serve` passes the listening one to psd, which serves on it.
"""
import os
import signal
import socket
import sys
import time

HOST = "127.0.0.1"


def usage():
    sys.exit(__doc__.split("\n\n")[1])


def bound_socket(port, reuse_addr=False, host=HOST):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Not on a reserved socket: SO_REUSEADDR there would let any SO_REUSEADDR bind (psd's own,
    # for one) share the port while it is not listening.
    if reuse_addr:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.rename(path + ".tmp", path)


def hold():
    # Held until the test that started us is gone (its EXIT trap kills us; a test killed with -9
    # leaves us to notice that our parent changed), or for an hour at most.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    deadline = time.monotonic() + 3600
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.2)


def reserve(count, path):
    socks = [bound_socket(0) for _ in range(count)]
    write_atomically(path, ",".join("%s:%d" % (HOST, s.getsockname()[1]) for s in socks))
    hold()


def reserve_shared(hosts, path):
    # The kernel picks a free port on the first IP; the others may have it in use: then another.
    for _ in range(100):
        socks = [bound_socket(0, host=hosts[0])]
        port = socks[0].getsockname()[1]
        try:
            for h in hosts[1:]:
                socks.append(bound_socket(port, host=h))
        except OSError:
            for s in socks:
                s.close()
            continue
        write_atomically(path, str(port))
        hold()
        return
    sys.exit("listen.py: no port is free on all of " + ",".join(hosts))


def serve(host, port, systemd, command):
    s = bound_socket(port, reuse_addr=True, host=host)
    s.listen(socket.SOMAXCONN)
    fd = s.detach()
    if fd != 3:
        os.dup2(fd, 3)  # dup2 leaves the new descriptor inheritable
        os.close(fd)
    else:
        os.set_inheritable(3, True)
    if systemd:
        os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.exit("listen.py: cannot run %s: %s" % (command[0], e))


def main(argv):
    if len(argv) == 3 and argv[0] == "reserve" and argv[1].isdigit():
        reserve(int(argv[1]), argv[2])
    elif len(argv) == 3 and argv[0] == "reserve-shared":
        reserve_shared(argv[1].split(","), argv[2])
    elif argv[:1] == ["serve"] and "--" in argv:
        own, command = argv[1:argv.index("--")], argv[argv.index("--") + 1:]
        host = own[own.index("--host") + 1] if "--host" in own else HOST
        port = own[-1] if own else ""
        if not port.isdigit() or not command:
            usage()
        serve(host, int(port), "--systemd" in own, command)
    else:
        usage()


if __name__ == "__main__":
    main(sys.argv[1:])
