"""The scheduler's phases, one file each; `moe_serve/scheduler.py`'s `Scheduler` puts them together.

    prefix_cache.py   prefix-cache admission: block hashes, prefix hits, registering full blocks,
                      per-sequence state snapshots at the prompt's last block boundary
    kv_transfer.py    disaggregation bookkeeping: blocks reserved for a prefill instance's write,
                      held for a write to the decode side, and set aside while a write may land
"""
