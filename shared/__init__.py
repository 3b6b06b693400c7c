"""burstrl's common library: settings, wire schema, stream bus, object store, health.

Every service imports from here, so nothing in this package may import torch or vllm:
the light services (api, reward) must start in well under a second.
"""

__version__ = "0.1.0"
