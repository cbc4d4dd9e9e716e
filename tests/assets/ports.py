"""Listeners for the firewall tests, run on a test host: `ports.py tcp:9100 udp:9104 fwd:45022`.

tcp:PORT accepts and closes; udp:PORT echoes each datagram back (udp6:PORT: over IPv6);
fwd:PORT relays every connection to 127.0.0.1:22 (SSH reached through a port forwarder, a
port sshd itself does not listen on: `ss` names the forwarder, not sshd).
"""

import socket
import sys
import threading


def tcp(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port), reuse_port=False, backlog=64)
    while True:
        conn, _ = srv.accept()
        conn.close()


def udp(port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("0.0.0.0", port))
    while True:
        data, peer = srv.recvfrom(512)
        srv.sendto(data, peer)


def udp6(port: int) -> None:
    """udp:PORT over IPv6 (link-local peers too), alone on the port (IPV6_V6ONLY)."""
    srv = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    srv.bind(("::", port))
    while True:
        data, peer = srv.recvfrom(512)
        srv.sendto(data, peer)


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def fwd(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port), backlog=64)
    while True:
        client, _ = srv.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", 22), timeout=10)
        except OSError:
            client.close()
            continue
        upstream.settimeout(None)
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()


if __name__ == "__main__":
    kinds = {"tcp": tcp, "udp": udp, "udp6": udp6, "fwd": fwd}
    threads = []
    for arg in sys.argv[1:]:
        kind, port = arg.split(":")
        threads.append(threading.Thread(target=kinds[kind], args=(int(port),), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
