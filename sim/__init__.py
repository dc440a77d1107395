"""Stand-ins for GPUs we do not have: performance model, engine emulator, cluster simulator."""
