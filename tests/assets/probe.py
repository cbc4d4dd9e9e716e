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
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.settimeout(3)
        sock.sendto(b"ping", (address, port))
        sock.recvfrom(512)
    print("open")
except OSError as exc:
    print(f"closed {exc!r}")
