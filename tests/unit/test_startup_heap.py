"""A server's start-up objects are frozen out of the garbage collector's full collections (scheduler.startup_heap),
which walked ~360,000 of them for ~200 ms in a started scheduler; checked in a child interpreter, whose collector
state this process does not share."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import gc, json, weakref
from scheduler.startup_heap import freeze_startup_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

kept = [cycle() for _ in range(1000)]
dropped = cycle()
dropped_ref = weakref.ref(dropped)
del dropped
frozen = freeze_startup_heap()
tracked = {id(o) for o in gc.get_objects()}
later = cycle()
later_ref = weakref.ref(later)
del later
gc.collect()
print(json.dumps({
    "frozen": frozen,
    "kept_out_of_collections": not any(id(node) in tracked for node in kept),
    "start_garbage_collected": dropped_ref() is None,
    "later_garbage_collected": later_ref() is None,
}))
"""


def test_the_start_s_live_objects_leave_collections_its_garbage_is_freed_and_later_cycles_still_are() -> None:
    result = json.loads(
        subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    )
    assert result["frozen"] >= 2000  # the kept cycles' nodes at least
    assert result["kept_out_of_collections"]
    assert result["start_garbage_collected"]
    assert result["later_garbage_collected"]
