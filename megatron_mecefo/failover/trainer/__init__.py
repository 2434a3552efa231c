"""The trainer side of failover: the run control the session drives (`manager`), the live
membership (`membership`) with its abortable collectives (`collectives`) and commit vote
(`commit`), regroup at step boundaries (`regroup`, `groups`), state transfer to (re)joining
replicas (`transfer`), and the trainer's view of the store (`plane`)."""
