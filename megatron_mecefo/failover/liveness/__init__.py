"""Liveness: who is alive, slow or gone. The trainer's heartbeat thread (`heartbeat`), the node
agents' kernel evidence (`evidence`), the coordinator's detector (`detector`) and GPU health
(`gpu_health`). Judgements only: the membership authority decides what follows from them."""
