"""One OpenMP thread team on the cores: the calling thread's team handed back to the runtime.

Who calls it: `EngineCore` at the end of its build (after the start-up probes), and `AsyncLLM`
in the thread that built the engine, right before it starts the engine thread that runs every
step from then on (the engine may have been built earlier and the thread used since). A thread
that steps an engine makes its own team at its first parallel region.

torch and hetserve's kernels share one OpenMP runtime (libgomp, pool.c), which keeps a team of
worker threads for each thread that has opened a parallel region. Building the engine (weights,
start-up probes) opens regions in the caller's thread; the engine thread's first step opens its
own. With two teams alive on a 2-core machine there are more OpenMP threads than CPUs, and
libgomp then cuts its workers' spin-wait from hundreds of thousands of turns to a thousand:
between two kernels a worker goes to sleep, and every parallel region of the step wakes it
through the kernel (~10-60 us each on this VM, where a region of a single team costs ~1-2 us).
Measured (2026-11-29, 3 streams, steps driven from a second thread): the demo model's decode
step 0.80-0.92 ms against 0.43-0.53 in the first thread, the 1.7 B MoE's 19.4-20.9 ms against
14.7-17.9; with the first thread's team released, 0.43 and 17.0-17.4 ms.

`release_thread_team()` asks the runtime (`omp_pause_resource_all`, OpenMP 5.0) to free the
calling thread's team; a later parallel region in that thread starts a new one. Failure: where
no OpenMP runtime is loaded, or it lacks that call (OpenMP < 5.0), nothing is done and it
returns False; it never raises.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the team's threads, not only park them
# GNU OpenMP only: its pause frees the calling thread's team alone (LLVM's and Intel's shut the
# whole runtime down, every thread's team with it)
_RUNTIMES = ("libgomp",)


def _loaded_runtimes() -> list[str]:
    """Paths of the GNU OpenMP runtimes mapped into this process (torch's libgomp)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line and ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(_RUNTIMES))


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP team (see the module docstring). True when a loaded
    runtime took the request. Call it outside any parallel region, before the threads that
    take over the compute start their own regions."""
    released = False
    for path in _loaded_runtimes():
        try:  # RTLD_NOLOAD: the copy already in the process, never a second one
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        rc = pause(OMP_PAUSE_HARD)
        if rc == 0:
            released = True
        else:
            log.debug("omp_pause_resource_all returned %d in %s", rc, path)
    return released
