"""A model's image processor built from several threads at once, in a fresh process (transformers' lazy
imports not yet done): every thread gets it. Before the lock in images._processor, concurrent first builds
raised ImportError ("cannot import name ... from 'transformers'") in the scheduler's image-check threads."""

import json
import subprocess
import sys

from temper.services.models.tiny_vision import TINY_MAX_PIXELS, TINY_MIN_PIXELS

CHILD = """
import json, sys, threading
from temper.services.models import images
text = sys.argv[1]
built, errors = [], []
start = threading.Barrier(8)
def build():
    start.wait()
    try:
        built.append(images.VisionProcessor(images.VisionTokens(3, 1, 2), images._processor(text), text).count(64, 64))
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=build) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"built": built, "errors": errors}))
"""


def test_processor_builds_from_many_threads_in_a_fresh_process():
    config = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
              "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "size": {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["built"] == [4] * 8, out
