"""Whether a DRAM reservation fits this host, checked before the memory is taken.

Who calls it: the stores that reserve and touch their DRAM at start (the local store's arena,
a pool node's segment), before they map it. Why: a reservation is touched in full at start
(first-touch faults would cost ~20x the copies later), so one larger than the host's memory
is not refused by the kernel but ends in its out-of-memory killer, which also takes unrelated
processes. Failure: InvalidInputError naming the option and the host's available memory; where
/proc/meminfo cannot be read (not Linux) nothing is checked.
"""

from __future__ import annotations

from hetserve.errors import InvalidInputError

# Of the memory available now, what a reservation may take: the process around it, its model
# and the kernel's page cache need the rest.
MAX_SHARE = 0.9


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes; None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_reservation(nbytes: int, what: str, fix: str, available: int | None = None) -> None:
    """Refuse reserving `nbytes` of DRAM past MAX_SHARE of what the host has available: `what`
    names the reservation ("a pool node's --dram"), `fix` the option to lower ("--dram")."""
    avail = available_bytes() if available is None else available
    if avail is None or nbytes <= MAX_SHARE * avail:
        return
    raise InvalidInputError(
        f"{what} of {_gib(nbytes)} is more than this host can give ({_gib(avail)} of memory "
        f"available now): lower {fix} to at most ~{_gib(int(MAX_SHARE * avail))}"
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
