"""`probe.py ADDRESS tcp|udp PORT`: prints "open" when a TCP connection is accepted or a UDP
datagram is echoed back (tests/assets/ports.py) within 3 s, else "closed <why>". Run on the
controller or on a test host, to see a firewall's verdict from that source."""

import socket
import sys

address, proto, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    if proto == "tcp":
        socket.create_connection((address, port), timeout=3).close()
    else:
        # IPv4 or IPv6; a link-local address carries its interface: fe80::1%eth0
        family, kind, _, _, peer = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
        sock = socket.socket(family, kind)
        sock.settimeout(3)
        sock.sendto(b"ping", peer)
        sock.recvfrom(512)
    print("open")
except OSError as exc:
    print(f"closed {exc!r}")
