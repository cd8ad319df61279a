"""BLAS on the calling thread only, in a server process.

The guard's and the roller's linear algebra is on small vectors (a cohort's few thousand
rows: `scale @ latency_count` and the like). NumPy's OpenBLAS hands such a product to its
own thread pool, and on a busy host every call then waits for sleeping threads to wake:
a health view's 88 dot products of at most 18k entries took 60 ms in all (0.3 ms each)
where one thread takes 1.6 ms, and the whole view went from 378-701 ms to 233-272 ms
(`bench/telemetry.py`'s health view, 10k devices, SQLite, on this project's 2-core
machine while other work ran). Report ingestion waited on them too, in the roller's
products: `bench/telemetry.py --quick`'s `report_vs_echo` went from 0.19-0.27 to
0.28-0.39 (two interleaved pairs, SQLite and PostgreSQL) at the same server CPU per batch.
A server handles calls on threads of its own; BLAS threads on top of them only compete
for the same cores.
"""

from __future__ import annotations


def one_blas_thread() -> None:
    """Limit the BLAS libraries loaded in this process (NumPy's) to one thread each."""
    import numpy  # noqa: F401 - loads the BLAS library threadpoolctl is to find
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
