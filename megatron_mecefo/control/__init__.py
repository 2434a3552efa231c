"""The job's control plane as data: the store's key schema (`keys`), the typed records written
there (`records`: generation, registration, node report, event), the node-local channel between
trainers and their agent (`local_beat`) and process lifetimes (`proc`).

Everything here is protocol, not policy: who decides what lives in `failover/`. No module here
imports torch at import time (the agent and the coordinator import it cheaply).
"""
