"""Pure logic: errors, layer ranges, sampling, generation, the planner, metrics, numerics
classes. No sockets, no engine, no threads: every module here is tested with plain data.
Imports nothing of meshnet outside core."""
