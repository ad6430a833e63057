"""`settle_heap` / `settled_heap`: the build's objects frozen, young collections made rarer."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from inference.gc_policy import YOUNG_THRESHOLD, settled_heap


def test_settle_heap_freezes_the_survivors_and_raises_only_the_young_threshold():
    # In a process of its own: the policy is for a whole process's life.
    code = textwrap.dedent(
        """
        import gc
        from inference.gc_policy import YOUNG_THRESHOLD, settle_heap

        gc.set_threshold(700, 11, 12)
        kept = [[i] for i in range(5000)]  # tracked objects that survive the collection
        frozen = settle_heap()
        assert frozen == gc.get_freeze_count() >= 5000, frozen
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12), gc.get_threshold()
        # A step's transient objects (a few thousand) no longer trigger a young collection.
        gc.collect()
        runs = []
        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
        for _ in range(100):
            step = [{"token": i} for i in range(3000)]
            del step
        assert runs == [], runs
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_settled_heap_restores_the_collector_after_the_block():
    before = gc.get_threshold()
    with settled_heap():
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD and gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
