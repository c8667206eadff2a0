"""The one executor (`executor`) and the target adapters it drives.

A target is an adapter registered by name: `register_target(name, description, factory)`. For a
vLLM-shaped manager, subclass `ManagerSide` (see kvcache_target.py and vllm_target.py).
"""

from kvfuzz.harness.manager_side import ManagerSide
from kvfuzz.harness.targets import register_target

__all__ = ["ManagerSide", "register_target"]
