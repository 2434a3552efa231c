"""The distributed optimizer: shards of fp32 master weights and AdamW moments over logical
replicas (`sharded`), their flat layout, placement and update arithmetic."""
