import os
import subprocess
import sys

from launch.memory import tree_pss_mb, tree_pss_parts_mb


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
