"""The control plane: job API, prompt feeder, service registry, metrics history."""
