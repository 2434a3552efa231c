"""Failover for real process deaths, one home per mechanism:

- `liveness/`: heartbeat, the agents' kernel evidence, the detector, GPU health;
- `authority/`: the membership coordinator (generations, restore, events, spare nodes) and the
  store host (`mecefo-coordinator`);
- `trainer/`: the trainer side (`FailoverManager`: join, per-step plan, live membership with the
  commit vote, regroup, state transfer);
- `node/`: the per-node agent (`mecefo-launch`) and its restart policy.

The store's key schema and records are `megatron_mecefo.control`; the membership the engine sees
is `megatron_mecefo.training.membership`; failure injection is `megatron_mecefo.testing`.
Importing this package imports nothing heavy; submodules import torch where they need it.
"""
