import os
import subprocess
import sys

from launch.memory import tree_peak_rss_mb, tree_pss_mb, tree_pss_parts_mb


def test_tree_memory_counts_children():
    # a child that holds 200 MB of touched memory raises the tree's total by about that much
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
                              "print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        alone = tree_pss_mb(child.pid)
        total = tree_pss_mb(os.getpid())
        assert alone > 190
        assert total > alone  # the child is part of this tree
        parts = tree_pss_parts_mb({child.pid: "holder"})
        assert parts["holder"] > 190 and parts["launcher"] > 0  # the child's 200 MB under its name
        assert abs(sum(parts.values()) - tree_pss_mb(os.getpid())) < 20  # the split adds up to the tree
    finally:
        child.stdin.close()
        child.wait()


def test_a_named_grandchild_is_counted_under_its_name():
    # launcher -> forkserver -> worker: the worker's memory goes under its name, the forkserver's under
    # "other"
    holder = ("import sys; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
              "print('ready', flush=True); sys.stdin.read()")
    middle = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys; "
                               "c = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
                               "print(c.pid, flush=True); c.wait()", holder],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        grandchild = int(middle.stdout.readline())
        assert middle.stdout.readline().strip() == b"ready"
        parts = tree_pss_parts_mb({grandchild: "holder"})
        assert parts["holder"] > 190 and parts["other"] > 0  # "other": the middle process, among others
        assert abs(sum(parts.values()) - tree_pss_mb(os.getpid())) < 20
        # the tree's largest sees the grandchild
        assert tree_peak_rss_mb() >= tree_peak_rss_mb(grandchild) > 190
    finally:
        middle.stdin.close()
        middle.wait()
