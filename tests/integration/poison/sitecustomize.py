"""A fault injected into the node processes of a test cluster (on PYTHONPATH, with
MOE_TEST_POISON_SEED set): the sampler of a sequence with that seed raises once it has fed
MOE_TEST_POISON_AFTER tokens, as a kernel that fails on one sequence's parameters would. Nothing
else changes: the module is wrapped as it loads."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

SEED = os.environ.get("MOE_TEST_POISON_SEED")
AFTER = int(os.environ.get("MOE_TEST_POISON_AFTER", "0"))
TARGET = "moe_cluster.node.sampling"


class _Poison(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            real = module.draw  # every sampled token's, one per step or per verified position

            def draw(s, logprobs, key):
                if s.req.sampling.seed == int(SEED) and len(s.fed) >= AFTER:
                    raise RuntimeError(
                        f"poisoned sampler of request {s.req.request_id} (test fault)"
                    )
                return real(s, logprobs, key)

            module.draw = draw

        spec.loader.exec_module = exec_module
        return spec


if SEED:
    sys.meta_path.insert(0, _Poison())
