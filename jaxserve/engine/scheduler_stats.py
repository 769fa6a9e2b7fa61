"""What the scheduler reports (Scheduler.stats()): queue lengths, pages, prefix-cache and host-tier
counters, LoRA occupancy; read by /metrics, the logs and the tests. Pure Python."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    prefix_cache_queries: int   # prompt tokens looked up at admission
    prefix_cache_hits: int      # of those, tokens served from the cache
    num_preemptions: int
    lora_running: dict[str, int] = dataclasses.field(default_factory=dict)  # adapter -> running sequences
    lora_waiting: dict[str, int] = dataclasses.field(default_factory=dict)  # adapter -> waiting sequences
    lora_slot_loads: int = 0    # adapters loaded into a device slot
    # host KV tier
    num_host_pages: int = 0
    num_host_pages_used: int = 0
    host_hit_tokens: int = 0    # prompt tokens whose pages came back from the host tier (swap-ins included)
    num_demotions: int = 0      # pages moved device -> host
    num_promotions: int = 0     # pages moved host -> device
    num_swap_preemptions: int = 0  # preemptions that kept the pages (swap) rather than recompute them
    num_swapped_in_pages: int = 0  # pages a resumed preempted sequence got back from the host tier
