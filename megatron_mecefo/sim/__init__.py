"""SPARe math, the cluster failure simulator and the planner (DESIGN.md section 7).

Pure Python + numpy/scipy: nothing in this package imports torch or megatron, so the simulator runs
on any machine and in CPU-only CI. The CLI is `mecefo-sim` (`megatron_mecefo.sim.cli`).
"""
