"""What the engine loop runs on, apart from the model: its CPUs and threads, the hand-off of events to asyncio,
and the counters of where its steps' time goes.

cpus.py: the CPUs the operating system grants the process and how busy others keep them; threads.py: the intra-op
threads each step uses, fitted to those CPUs; mailbox.py: events from the engine thread to an event loop, one wakeup
a step; step_stats.py: cumulative counters of the steps, by phase. None of it knows about requests or models.
"""
