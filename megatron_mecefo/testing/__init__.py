"""Fault injection with real signals, for tests, the chaos soak and users who want to see
failover work: `inject` (a loop hook, `mecefo-train --inject`) and `inject_cli`
(`mecefo-inject`, a signal from outside). Nothing on the training path imports this package unless
a job asks for injections."""
