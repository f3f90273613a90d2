"""Imported by the compile processes' fork server before anything else it preloads (see ``compile_processes``).

The fork server imports a main module run with ``-m`` by its name (``scheduler.launch``), so that every child
finds the server's imports done; multiprocessing then still runs that module's body in each child as
``__mp_main__`` (cheap: its imports are there). runpy warns that a module of a package it runs is already imported;
here that is the point, so the warning is silenced in the fork server and its children only.
"""

import warnings

warnings.filterwarnings(
    "ignore",
    message=r"'[\w.]+' found in sys\.modules after import of package '[\w.]+', but prior to execution of",
    category=RuntimeWarning,
)
