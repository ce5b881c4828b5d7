
import os

from registry import Registry

# An engine is a module of this package exposing SPEC, its EngineSpec class (engines/base.py): what it can do,
# where a plan puts it (`on_cpu`, `on_gpu`), how a rollout process builds it (`open`) and how weight buckets
# travel to it (`bucket_payloads`). The rest of the package is the engines' shared machinery.
ENGINES = Registry("engine", __name__, os.path.dirname(__file__),
                   helpers=("arch", "base", "buckets", "hf", "llama", "sampler", "static_decode",
                            "weight_sync", "weights"))
