"""Where a whole run's CPU goes: BSD process accounting (acct(2)), by command name.

    python3 bench/pacct.py on /tmp/run.pacct     # as root: every process that exits from now on
    CI=true bash .ci/run                          # ... the run (containers' processes included)
    python3 bench/pacct.py off
    python3 bench/pacct.py report /tmp/run.pacct [TOP]

The kernel writes one v3 record (64 bytes) per process at its exit, in every pid namespace up
to the machine's, so the test hosts' processes are counted too. Processes still running at
`off` (daemons) are not. Used for docs/testing.md's "Stop 34" figures.
"""

from __future__ import annotations

import collections
import ctypes
import struct
import sys

RECORD = struct.Struct("<BBHIIIIIIf8H16s")  # struct acct_v3 (linux/acct.h)
AHZ = 100


def acct(path: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if path is not None:
        open(path, "wb").close()
    if libc.acct(path.encode() if path else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"acct({path!r})")


def comp_t(value: int) -> int:
    """A comp_t: 13-bit mantissa, 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 7))


def report(path: str, top: int = 40) -> None:
    data = open(path, "rb").read()
    cpu: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for (flag, version, *fields) in RECORD.iter_unpack(data[: len(data) - len(data) % RECORD.size]):
        if version != 3:
            continue
        utime, stime, comm = fields[8], fields[9], fields[16]
        name = comm.split(b"\0")[0].decode(errors="replace")
        cpu[name] += (comp_t(utime) + comp_t(stime)) / AHZ
        count[name] += 1
    total = sum(cpu.values())
    print(f"total {total:.0f} CPU s in {sum(count.values())} processes")
    for name, seconds in cpu.most_common(top):
        print(f"{seconds:9.1f} s {100 * seconds / max(total, 1e-9):5.1f}%  {count[name]:7d}  {name}")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "on" and len(sys.argv) == 3:
        acct(sys.argv[2])
    elif command == "off":
        acct(None)
    elif command == "report" and len(sys.argv) in (3, 4):
        report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 40)
    else:
        raise SystemExit(__doc__)
