"""One field of /proc/self/smaps for the mapping that holds an address (the tests of the KV
pool's pages and of the weights' huge pages read Rss and AnonHugePages of their own memory)."""
from __future__ import annotations


def mapping_bytes(address: int, field: str) -> int:
    """`field` (e.g. "Rss", "AnonHugePages"), in bytes, of the mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")
