"""The single-replica engine: scheduler, paged KV + Mamba state pools, prefix cache, MTP."""
