"""How long an engine server's idle OpenMP workers spin before they sleep: libgomp's
GOMP_SPINCOUNT, set in the environment before torch loads libgomp (it reads it once)."""
from __future__ import annotations

import os

# libgomp's GOMP_SPINCOUNT, the pauses an idle OpenMP worker spins before it sleeps: its default
# (milliseconds on a current x86 core, after every parallel region), and an engine server's.
LIBGOMP_SPIN = "300000"
SERVER_SPIN = "3000"


def bound_openmp_spin() -> None:
    """An engine server's idle OpenMP workers spin briefly, then sleep, unless GOMP_SPINCOUNT or
    OMP_WAIT_POLICY is set (`pdserve up`, which plans its servers' cores, gives them libgomp's
    default). Runs before torch is imported: libgomp reads its environment once, when loaded.

    libgomp's default spin suits a process that has its cores to itself. A server shares them
    with whatever else the host runs (other containers, another tier's server), and does not know
    with what. Three engines of 2 threads each on 2 cores ran 10x slower than one alone (a
    spinning worker holds the core that its team's other thread waits for); with this bound
    2.7x, with no spin at all 2.4x (docs/benchmarks.md, "Idle OpenMP workers spin briefly")."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SERVER_SPIN
