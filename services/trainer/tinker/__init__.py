"""The trainer's Tinker worker (docs/tinker.md): Tinker models' training calls, applied under their jobs' leases."""
