"""kvcache: a clean-room paged KV-cache block manager with vLLM 0.34.0's four layers.

Layer 1 KVCacheManager (policy) -> layer 2 KVCacheCoordinator (fan-out over groups) ->
layer 3 SingleTypeKVCacheManager (per-group arithmetic) -> layer 4 BlockPool (ownership).
"""

from kvfuzz.kvcache.block_pool import BlockHashToBlockMap, BlockPool
from kvfuzz.kvcache.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvfuzz.kvcache.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvfuzz.kvcache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvfuzz.kvcache.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    resolve_kv_cache_block_sizes,
)
from kvfuzz.kvcache.request import Request, RequestStatus
from kvfuzz.kvcache.scheduler import Scheduler, StepOutput
from kvfuzz.kvcache.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CircularBufferManager,
    CrossAttentionManager,
    EncoderOnlyAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)

__all__ = [
    "AttentionSpec",
    "BlockHashToBlockMap",
    "BlockPool",
    "ChunkedLocalAttentionManager",
    "ChunkedLocalAttentionSpec",
    "CircularBufferManager",
    "CircularBufferSpec",
    "CrossAttentionManager",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionManager",
    "EncoderOnlyAttentionSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "MambaManager",
    "MambaSpec",
    "MLAAttentionSpec",
    "RSWAManager",
    "RSWASpec",
    "SinkFullAttentionSpec",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "StepOutput",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
    "get_request_block_hasher",
    "resolve_kv_cache_block_sizes",
]
