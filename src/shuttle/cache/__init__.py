"""Byte budget, leases, eviction policy, model and adapter specs, ``ModelCache.use``."""

from shuttle.cache.model_cache import ModelCache
from shuttle.cache.policy import CacheEntry, EvictionContext, EvictionPolicy, LRUEvictionPolicy
from shuttle.cache.resource_cache import CacheInfo, ResourceCache
from shuttle.cache.specs import LoRASpec, ModelSpec, ObjectSpec, Spec

__all__ = [
    "CacheEntry",
    "CacheInfo",
    "EvictionContext",
    "EvictionPolicy",
    "LRUEvictionPolicy",
    "LoRASpec",
    "ModelCache",
    "ModelSpec",
    "ObjectSpec",
    "ResourceCache",
    "Spec",
]
