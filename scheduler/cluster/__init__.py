"""Replicas (issue 32): which scheduler replica owns each trainer's lane, by a lease in PostgreSQL
with a fencing token, and the check every durable write of a lane makes before it writes
(docs/replicas.md). Lanes ask this layer whether they may write; they do not know how ownership is
kept. Builds on db and settings; below planning, which will call it."""
