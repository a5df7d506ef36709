"""Reading the kernel's page bookkeeping in tests: how much of a mapping sits in huge pages."""
from __future__ import annotations


def huge_pages_of(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0
