"""The Tinker API on the api service (docs/tinker.md).

protocol.py holds the JSON wire types and ids, wire.py the protobuf ones (tinker_wire.proto),
models.py and calls.py the domain functions (sessions, models, queued calls and their
futures), routes.py the thin routers under /api/v1.
"""
