"""The swarm: each stage's DHT node, matchmaking, the exact all-reduce and the state service.

Importing the package defers scipy.optimize, which hivemind imports and a peer's start never uses
(hivemind_patches.defer_scipy_optimize).
"""

from .hivemind_patches import defer_scipy_optimize

defer_scipy_optimize()
