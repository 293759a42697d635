"""Measuring runs, for ``plan`` and the benchmarks alike.

timed_runs    a configuration's training run in processes of its own, its figures read back
step_timer    ``StepTimer``, the callback that times a run's optimizer steps and records its peak memory
intervals     the median of repeated measurements and its distribution-free interval
busy_cores    the cores a process may use, and whether other processes keep them busy
"""

__all__ = ["busy_cores", "intervals", "step_timer", "timed_runs"]
